"""FSDP2 and FSDP1 round trips on real process groups (gloo on CPU; NCCL on GPUs, marked gpu)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parent / "offload_fsdp_worker.py"


def _run(wrappers: list[str], device: str, nproc: int, tmp_path: Path) -> dict:
    """One torchrun group runs every wrapper in turn; returns a report per wrapper."""
    out = tmp_path / f"{device}-{nproc}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        ",".join(wrappers),
        device,
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


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
