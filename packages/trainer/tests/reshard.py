"""Test helper (not a test module): worker scripts on gloo ranks; actor engines saving at
one world size and loading at another (``trainer_checkpoint_worker.py``)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


def run_script(world: int, script: str, *args: str, timeout: float = 300) -> None:
    """The worker ``script`` of this folder on ``world`` gloo ranks: one interpreter per rank
    with the variables ``torchrun`` would give it (``env://``: rank, world size, master
    address and port; one OpenMP thread), all started at once. Without ``torchrun``'s own
    interpreter in between: about 2 s less per group here. Fails the test with the output of
    each rank that did not exit 0 within ``timeout`` s (the first failure stops the others)."""
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
    }
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world)]
        ranks = [
            subprocess.Popen(
                [sys.executable, str(HERE / script), *args],
                env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=logs[rank],
                stderr=subprocess.STDOUT,
            )
            for rank in range(world)
        ]
        deadline = time.monotonic() + timeout
        try:  # as torchrun does: the first rank to fail stops the group
            while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in ranks):
                    break
                time.sleep(0.05)
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        failed = [r for r, proc in enumerate(ranks) if proc.returncode != 0]
        report = []
        for rank in failed:
            logs[rank].seek(0)
            report.append(
                f"--- rank {rank} (exit {ranks[rank].returncode}):\n{logs[rank].read()[-4000:]}"
            )
        assert not failed, f"{script} (limit {timeout:g} s):\n" + "\n".join(report)


def save_or_load(world: int, action: str, directory: Path, *cases: str) -> None:
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
