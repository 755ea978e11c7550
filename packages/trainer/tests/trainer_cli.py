"""Test helper (not a test module): run ``rlwire-train`` as a user does and read its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_cli(
    run: Path, *overrides: str, cluster: str | None = None, timeout: float = 600
) -> tuple[list[dict], str]:
    """``rlwire-train`` in a fresh interpreter writing to ``run``; its metrics and its output
    (stdout, then stderr).

    ``cluster``: the address of a running Ray cluster to join (the ``ray_cluster``
    fixture); ``None`` starts one embedded in the command, as the README's command does.
    Fails the test with the command's output when it does not exit 0.
    """
    cmd = [
        sys.executable,
        "-m",
        "rlwire.trainer.cli",
        "--no-progress",
        f"trainer.output_dir={run}",
        "ray.startup_timeout=300",
        *([f"ray.address={cluster}"] if cluster else []),
        *overrides,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return metrics(run), result.stdout + result.stderr


def checkpoint_state(checkpoint: Path) -> dict:
    """The actor state of ``checkpoints/step_<n>`` (DCP) as one dict of full tensors, read
    without a process group: ``{"model": {...}, "optimizer": {...}}``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = checkpoint / "actor.pt"
    dcp_to_torch_save(checkpoint / "actor", whole)
    try:
        return torch.load(whole, weights_only=False)
    finally:
        whole.unlink()
