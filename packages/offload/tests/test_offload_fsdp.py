"""FSDP2 and FSDP1 round trips on real process groups (gloo on CPU; NCCL on GPUs, marked gpu)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.spawn import start_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offload_fsdp_worker  # noqa: E402

# Ranks are forked from multiprocessing's fork server, which imports torch, FSDP and the
# worker once (torchrun started an interpreter of its own and one per rank: 5-6 s a group here,
# against 1-3 s). In one pytest process the server is shared: the last preload list set
# before its first use is the one it has, and a rank imports whatever it lacks.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed.fsdp", "offload_fsdp_worker"])


def _run(wrappers: list[str], device: str, nproc: int, tmp_path: Path) -> dict:
    """One group of ``nproc`` ranks runs every wrapper in turn; returns a report per wrapper."""
    out = tmp_path / f"{device}-{nproc}.json"
    _on_ranks(offload_fsdp_worker.main, nproc, ",".join(wrappers), device, str(out))
    return json.loads(out.read_text())


def _on_ranks(main, nproc: int, *args: str, timeout: float = 300) -> None:
    """``main(*args)`` on ``nproc`` ranks with the variables torchrun would set (``env://``),
    forked from multiprocessing's fork server (torch imported there once, not per rank).
    A rank that raises or exits non-zero fails the test with its error; all are killed after
    ``timeout`` s."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = start_processes(
        _rank, args=(main, nproc, port, args), nprocs=nproc, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ranks.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nproc} ranks did not finish within {timeout:g} s")
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def _rank(rank: int, main, world: int, port: int, args: tuple[str, ...]) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
    env |= {"LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    os.environ.update(env)
    torch.set_num_threads(1)  # the fork server read OMP_NUM_THREADS when it imported torch
    main(*args)


def _assert_round_trips(report: dict, *, pinned: bool) -> None:
    # Offloading between steps changes nothing: same losses, same parameters, bit for bit.
    assert report["losses_moved"] == report["losses_ref"]
    assert report["params_equal"]
    for cycle, check in enumerate(report["checks"]):
        assert check["nbytes"] > 0
        assert check["on_host"] and check["in_pool"] and check["host_equal_after_wait"], check
        assert check["round_trip_equal"] and check["identity"], check
        assert check["pinned"] is (True if pinned else None), check
        # Model and optimizer each hold one slab: two allocations, then only reuse.
        assert check["allocations"] == 2, check
        assert check["reuses"] == 2 * cycle, check


# One FSDP1 rank runs NO_SHARD (its local shard aliases the whole flat parameter).
GLOO_CASES = {2: ["fsdp2", "fsdp1", "fsdp1_orig_params"], 1: ["fsdp1", "fsdp1_orig_params"]}


@pytest.mark.parametrize("nproc", sorted(GLOO_CASES))
def test_round_trip_on_gloo(nproc, tmp_path):
    reports = _run(GLOO_CASES[nproc], "cpu", nproc, tmp_path)
    assert sorted(reports) == sorted(GLOO_CASES[nproc])
    for report in reports.values():
        _assert_round_trips(report, pinned=False)
        assert report["checks"][0]["device_after_load"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("wrapper", ["fsdp2", "fsdp1"])
def test_round_trip_on_gpus(wrapper, nproc, tmp_path):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    report = _run([wrapper], "cuda", nproc, tmp_path)[wrapper]
    _assert_round_trips(report, pinned=True)
    assert report["checks"][0]["device_after_load"].startswith("cuda")
