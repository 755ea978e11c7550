"""FSDP2 and FSDP1 round trips on real process groups (gloo on CPU; NCCL on GPUs, marked gpu)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import offload_fsdp_worker  # this folder: pytest puts it on sys.path
import pytest
import torch
from torch.multiprocessing.spawn import start_processes

# Ranks are forked from multiprocessing's fork server, which imports torch, FSDP and the
# worker once (what it preloads is set in conftest.py, once for the process).


def _run(wrappers: list[str], device: str, nproc: int, tmp_path: Path) -> dict:
    """One group of ``nproc`` ranks runs every wrapper in turn; returns a report per wrapper."""
    out = tmp_path / f"{device}-{nproc}.json"
    _on_ranks(offload_fsdp_worker.main, nproc, ",".join(wrappers), device, str(out))
    return json.loads(out.read_text())


def _on_ranks(main, nproc: int, *args: str, timeout: float = 300) -> None:
    """``main(*args, init_method=...)`` on ``nproc`` ranks with the rank variables torchrun
    would set, forked from multiprocessing's fork server (torch imported there once, not per
    rank). The ranks meet through a file (a FileStore), not a port picked here that another
    process could take before rank 0 binds it. A rank that raises or exits non-zero fails the
    test with its error; all are killed after ``timeout`` s."""
    with tempfile.TemporaryDirectory(prefix="rlwire-ranks-") as meeting:
        store = f"file://{os.path.join(meeting, 'store')}"
        ranks = start_processes(
            _rank,
            args=(main, nproc, store, args),
            nprocs=nproc,
            join=False,
            start_method="forkserver",
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


def _rank(rank: int, main, world: int, store: str, args: tuple[str, ...]) -> None:
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
    env |= {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    os.environ.update(env)
    torch.set_num_threads(1)  # the fork server read OMP_NUM_THREADS when it imported torch
    main(*args, init_method=store)


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
