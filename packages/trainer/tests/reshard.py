"""Test helper (not a test module): worker scripts under torchrun; actor engines saving at
one world size and loading at another (``trainer_checkpoint_worker.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent


def run_script(world: int, script: str, *args: str) -> None:
    """The worker ``script`` of this folder under ``torch.distributed.run`` on ``world`` gloo
    ranks; fails the test with its output when it does not exit 0."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(HERE / script),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def torchrun(world: int, action: str, directory: Path, *cases: str) -> None:
    """``trainer_checkpoint_worker.py`` on ``world`` gloo ranks (see its docstring)."""
    run_script(world, "trainer_checkpoint_worker.py", action, str(directory), *cases)


def assert_resharded(directory: Path, case: str, saved_at: int, loaded_at: int) -> None:
    """The state loaded at ``loaded_at`` ranks is the one saved at ``saved_at``, bit for bit
    (weights, Adam moments, step counts), and it trains on (one more step changes it)."""
    saved = torch.load(directory / f"{case}.save.{saved_at}.pt")["saved"]
    after = torch.load(directory / f"{case}.load.{loaded_at}.pt")
    loaded, stepped = after["loaded"], after["stepped"]
    assert loaded.keys() == saved.keys()
    assert any("exp_avg_sq" in k for k in saved) and any(k.startswith("/model/") for k in saved)
    different = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert different == []
    steps = sorted({float(v) for k, v in loaded.items() if k.endswith("/step")})
    assert steps == [2.0]  # two optimizer steps before the save
    assert sorted({float(v) for k, v in stepped.items() if k.endswith("/step")}) == [3.0]
