"""A one-host run listens on loopback only, but for Ray's own servers, which take only
callers holding the run's token (issue 64, item 5).

Ray's servers listen on every interface whatever node address they are given (Ray turns
loopback into the node's IP), so the embedded cluster runs under Ray's token
authentication with a token drawn for the run; everything of the run's own (the actor
group's gloo pairs and store, the checkpoint engine's gloo pairs and store) listens on
loopback."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlwire.ckpt_engine.backends._gloo import gloo_options
from rlwire.trainer.rollout.listeners import held_sockets, listening_sockets, process_tree

_RAY_SERVERS = ("gcs_server", "raylet")  # and every Ray worker's core-worker port
_OURS = ("ray::ActorWorke", "ray::RolloutWor", "ray::SampleQueu")  # comm: 15 characters


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _post_status(address: ipaddress._BaseAddress, port: int) -> int:
    """The HTTP status a POST without credentials gets from ``address:port``."""
    import http.client

    connection = http.client.HTTPConnection(str(address), port, timeout=10)
    try:
        connection.request("POST", "/get_or_create_runtime_env", body=b"")
        return connection.getresponse().status
    finally:
        connection.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _listeners_by_process(root: int) -> list[tuple[int, str, ipaddress._BaseAddress, int]]:
    """(pid, command, address, port) of every socket the process tree of ``root`` listens
    on."""
    every = listening_sockets()
    found = []
    for pid in sorted(process_tree(root)):
        for inode in held_sockets({pid}):
            if inode in every:
                address, port = every[inode]
                found.append((pid, _comm(pid), address, port))
    return found


def test_gloo_pairs_listen_where_the_store_does():
    """The checkpoint engine's gloo group on a loopback store: its pairs listen on
    loopback, not on the address the hostname resolves to (gloo's default)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    options = gloo_options(store.host, 30.0)
    before = set(held_sockets({os.getpid()}))
    group = dist.ProcessGroupGloo(store, 0, 1, options)
    group.allreduce([torch.ones(1)]).wait()
    every = listening_sockets()
    mine = [every[i] for i in held_sockets({os.getpid()}) - before if i in every]
    assert all(address.is_loopback for address, _ in mine), mine
    wide = gloo_options("10.1.2.3", 30.0)  # across hosts: gloo's default device stays
    assert len(wide._devices) == 1 and len(options._devices) == 1


@pytest.mark.job
def test_a_one_host_run_listens_on_loopback_but_for_rays_servers_under_its_token(tmp_path):
    """A fully-async run, 2 actor ranks over gloo, 2 rollout workers, the checkpoint engine
    on gloo, in a cluster of its own (as ``uv run rlwire-train`` starts one): while it
    trains, every socket its processes listen on is on 127.0.0.0/8, or is a Ray server's
    (the GCS, the raylet, a worker's core-worker port, on the wildcard address) in a
    process whose Ray runs with token authentication; no token is on a command line."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "rlwire.trainer.cli",
        "--no-progress",
        f"trainer.output_dir={run}",
        "trainer.mode=fully_async",
        "trainer.steps=6",
        "actor.world_size=2",
        "rollout.num_workers=2",
        "ckpt_engine.backend=gloo",
        "ray.startup_timeout=300",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "GLOO_"))}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[tuple[int, str, ipaddress._BaseAddress, int]] = []
    environs: dict[int, dict[str, str]] = {}
    try:
        # watched until a look finds both actor ranks and both rollout workers up, the
        # actor group's gloo pairs among their sockets (the workers are Ray's, below the
        # raylet, itself below the driver)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and process.poll() is None:
            look = _listeners_by_process(process.pid)
            workers = {pid for pid, comm, *_ in look if comm in _OURS}
            if len(workers) >= 4 and sum(comm == _OURS[0] for _, comm, *_ in look) > 2:
                seen = look
                environs = {pid: _environ(pid) for pid in process_tree(process.pid)}
                commands = {pid: _cmdline(pid) for pid in environs}
                # Ray's agents (HTTP, on the node's IP) while the run is up: asked without
                # the token
                agent_answers = [
                    _post_status(address, port)
                    for pid, comm, address, port in seen
                    if comm.startswith("ray::")
                    and comm not in _OURS
                    and not address.is_loopback
                    and not address.is_unspecified
                ]
                break
            time.sleep(0.25)
        assert seen, "the run's workers were never seen up"
    finally:
        out, _ = process.communicate(timeout=400)
    assert process.returncode == 0, out[-4000:]
    print("\n".join(f"{pid} {comm} {address} {port}" for pid, comm, address, port in seen))

    # the run's own sockets: the actor ranks' and the checkpoint engine's gloo pairs
    workers = {pid for pid, comm, *_ in seen if comm in _OURS}
    assert len(workers) >= 4, seen  # 2 actor ranks, 2 rollout workers
    assert any(address.is_loopback for pid, _, address, _ in seen if pid in workers), seen
    for pid, comm, address, port in seen:
        if address.is_loopback:
            continue
        # Ray's gRPC servers listen on the wildcard address; its agents on the node's IP
        ray_server = address.is_unspecified and (
            comm.startswith("ray::") or comm in _RAY_SERVERS or pid == process.pid
        )
        ray_agent = comm.startswith("ray::") and comm not in _OURS
        assert ray_server or ray_agent, f"{comm} (pid {pid}) listens on {address}:{port}"
    # Ray's processes start with the run's token (the driver's own /proc environ is the one
    # it was started with: the token was set in it later)
    (gcs,) = [pid for pid, comm, *_ in seen if comm == "gcs_server"]
    token = environs[gcs].get("RAY_AUTH_TOKEN")
    assert token and len(token) >= 32
    for pid, comm, address, _ in seen:
        if pid != process.pid and address.is_unspecified:  # the agents: asked below
            assert environs[pid].get("RAY_AUTH_MODE") == "token", (pid, comm)
            assert environs[pid].get("RAY_AUTH_TOKEN") == token, (pid, comm)
    assert not any(token in line for line in commands.values())
    assert agent_answers and all(status == 401 for status in agent_answers), agent_answers
