"""Test helper (not a test module): run ``rlwire-train`` as a user does and read its metrics."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import subprocess
import sys
from pathlib import Path

# The FSDP2 run that the other strategies are compared with (FSDP1 in
# test_trainer_strategies.py, Megatron in test_trainer_megatron.py; conftest.py's
# ``fsdp2_reference_run`` runs it once per session). Two rollout engines, one per rank: the
# hybrid engine (each rank's own process), which test_trainer_strategies.py compares with
# rollout workers of their own. Here, not in conftest.py: a test module that imported it
# from ``conftest`` got whichever conftest pytest imported last (every package's tests have
# one).
FSDP2_REFERENCE = (
    "actor.world_size=2",
    "rollout.num_workers=2",
    "actor.optim.grad_clip=0.5",
    "ckpt_engine.digest=true",
    "trainer.save_every=1",
)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_cli(
    run: Path, *overrides: str, cluster: str | None = None, timeout: float = 600
) -> tuple[int, str]:
    """``rlwire-train`` writing to ``run``: its exit code and its output (stdout, then stderr).

    ``cluster``: the address of a running Ray cluster to join (the ``ray_cluster``
    fixture): the command's ``main`` runs in this process, as a user's driver script calling
    it would, which spares each job a fresh interpreter's imports (about 2.5 s of CPU here);
    ``None`` runs the command in a fresh interpreter that starts its own cluster, as the
    README's command does. A run still going after ``timeout`` s ends the test session with
    every thread's stack.
    """
    argv = [
        "--no-progress",
        f"trainer.output_dir={run}",
        "ray.startup_timeout=300",
        *([f"ray.address={cluster}"] if cluster else []),
        *overrides,
    ]
    if cluster is None:
        cmd = [sys.executable, "-m", "rlwire.trainer.cli", *argv]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return result.returncode, result.stdout + result.stderr
    from rlwire.trainer.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return code, stdout.getvalue() + stderr.getvalue()


def train_cli(
    run: Path, *overrides: str, cluster: str | None = None, timeout: float = 600
) -> tuple[list[dict], str]:
    """:func:`run_cli`, which must exit 0 (else the test fails with the command's output):
    the run's metrics and its output."""
    code, out = run_cli(run, *overrides, cluster=cluster, timeout=timeout)
    assert code == 0, out[-6000:]
    return metrics(run), out


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
