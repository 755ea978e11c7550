"""What the ``vllm_server`` backend waits for, bounded (issue 64, item 12): the watchdog of a
server it starts knows its parent by more than its pid (a pid the kernel gives to a new
process once the parent exited must not keep the server alive), and a weight update the
server never answers, though it answers ``/health``, is lost after its bound."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from test_trainer_vllm_http import HeldRoutes
from vllm_stand_in import StandIn

from rlwire.trainer.rollout import EngineLost
from rlwire.trainer.rollout.vllm_http import VLLMServer
from rlwire.trainer.rollout.vllm_process import Parent, process_start

linux = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")


def _stat(pid: int, start: int, state: str = "S", name: str = "py (x) thon") -> str:
    """A ``/proc/<pid>/stat`` line: the command name holds a space and parentheses."""
    fields = [state, *["0"] * 18, str(start), *["0"] * 30]  # field 3 on; field 22 is start
    return f"{pid} ({name}) {' '.join(fields)}\n"


@pytest.fixture
def live():
    """A live process: its pid is taken (``os.kill(pid, 0)`` finds it) all along."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child.pid
    child.kill()
    child.wait()


def _proc(tmp_path, **stats: str):
    """A ``/proc`` of this process and of the pids given (``{"<pid>": stat line}``)."""
    for pid, line in {str(os.getpid()): _stat(os.getpid(), 1), **stats}.items():
        (tmp_path / pid).mkdir(exist_ok=True)
        (tmp_path / pid / "stat").write_text(line)
    return tmp_path


def test_a_pid_that_started_at_another_time_is_another_process(tmp_path, live):
    """The kernel gave the parent's pid to a new process: same pid, another start time."""
    proc = _proc(tmp_path, **{str(live): _stat(live, 1000)})
    parent = Parent(live, proc=proc)
    assert parent.started == 1000 and parent.alive()
    _proc(tmp_path, **{str(live): _stat(live, 1017)})  # reused
    assert not parent.alive()  # before the fix: alive (os.kill finds the pid)
    _proc(tmp_path, **{str(live): _stat(live, 1000, state="Z")})  # exited, not yet reaped
    assert not parent.alive()
    (proc / str(live) / "stat").unlink()
    assert not parent.alive()


def test_a_parent_gone_before_the_watchdog_looked_is_gone(tmp_path, live):
    parent = Parent(live, proc=_proc(tmp_path))  # /proc works, and shows no such process
    _proc(tmp_path, **{str(live): _stat(live, 1000)})  # then a new process took the pid
    assert not parent.alive()


@linux
def test_a_live_process_is_alive_and_a_dead_one_dead():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = process_start(child.pid)
        assert started is not None and started == process_start(child.pid)
        parent = Parent(child.pid)
        assert parent.alive() and not parent.child  # not this process's parent
        child.kill()
        deadline = time.monotonic() + 10
        while process_start(child.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # a zombie until reaped: already not alive
        assert not parent.alive()
        child.wait()
        assert not parent.alive() and process_start(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert Parent(os.getppid()).alive() and Parent(os.getppid()).child


@linux
def test_the_watchdog_stops_its_server_when_its_parent_exits(tmp_path):
    """A parent that exits: the watchdog (its child, reparented) stops the server."""
    pidfile = tmp_path / "server.pid"
    server = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, pathlib, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-m', 'rlwire.trainer.rollout.vllm_process',\n"
        f"                  str(os.getpid()), sys.executable, '-c', {server!r}])\n"
        f"pidfile = pathlib.Path({str(pidfile)!r})\n"
        "while not (pidfile.exists() and pidfile.read_text()):\n"
        "    time.sleep(0.05)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)])
    assert parent.wait(timeout=60) == 0  # the server started, and its parent exits
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while process_start(pid) is not None:
        assert time.monotonic() < deadline, "the server outlived its parent"
        time.sleep(0.1)


def _routes() -> dict:
    """A server's routes, all answered at once."""
    versions = {"results": [{"held": None, "staged": 5, "rlwire": True}]}
    return {
        "/health": (200, {}),
        "/start_weight_update": (200, {}),
        "/update_weights": (200, {}),
        "/collective_rpc": (200, versions),
        "/init_weight_transfer_engine": (200, {}),
    }


def test_an_update_the_server_never_answers_is_lost_after_its_bound():
    """``/health`` answers all along, ``/update_weights`` not while the test looks (its answer
    is held back): after ``update_timeout`` the server is lost (naming the route and the
    bound), and the call's thread ends too, by its own deadline, not by an answer."""
    routes = HeldRoutes(_routes(), held="/update_weights")
    stuck = StandIn(routes)
    try:
        client = VLLMServer(stuck.url, timeout=5, index=2)
        assert client.update_timeout == 2 * 300 + 30  # the library's ckpt_engine.timeout
        client.update_timeout = 1.0
        before = set(threading.enumerate())
        with pytest.raises(EngineLost, match=r"no answer to /update_weights within 1 s") as lost:
            client.receive_update(poll=0.25)
        assert lost.value.index == 2
        assert routes.asked.wait(30), "/update_weights was never asked"
        calls = [t for t in set(threading.enumerate()) - before if t.name == "rlwire-vllm-update"]
        for call in calls:
            call.join(timeout=30)  # its own deadline (1 s): the answer is still held back
        assert len(calls) == 1 and not calls[0].is_alive()
    finally:
        routes.released.set()
        stuck.close()


def test_the_update_bound_follows_the_checkpoint_engines_timeout():
    stuck = StandIn(_routes())
    try:
        client = VLLMServer(stuck.url, timeout=5)
        client.init_weight_transfer(
            "gloo", rank=1, world_size=2, metadata={"bucket_size": 1024, "delta": "off"},
            timeout=45.0,
        )  # fmt: skip
        assert client.update_timeout == 2 * 45 + 30
        assert client.receive_update(poll=0.25) == 5
    finally:
        stuck.close()
