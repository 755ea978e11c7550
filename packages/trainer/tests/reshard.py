"""Test helper (not a test module): worker scripts on gloo ranks; actor engines saving at
one world size and loading at another (``trainer_checkpoint_worker.py``)."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent


# Ranks are forked from one server that imported torch, transformers, the tiny model's
# modeling code and the worker scripts once: a rank starts in milliseconds instead of the
# 4-5 s of CPU those imports cost a fresh interpreter (7 ranks for the resharding fixture).
# The server is multiprocessing's, one per pytest process: what it preloads is set in
# conftest.py, once for the process.
_RANKS = multiprocessing.get_context("forkserver")


def _rank(script: str, argv: list[str], env: dict[str, str], store: str, log: str) -> None:
    """One rank, in a process forked from the server: ``script``'s ``main(init_method=store)``
    with the command line and the rank variables ``torchrun`` would give it, its output going
    to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    sys.argv = [script, *argv]
    torch.set_num_threads(1)  # OMP_NUM_THREADS is read when torch loads: in the server
    importlib.import_module(Path(script).stem).main(init_method=store)


def run_script(world: int, script: str, *args: str, timeout: float = 300) -> None:
    """The worker ``script`` of this folder (its ``main()``) on ``world`` gloo ranks, all
    started at once, each with the rank variables ``torchrun`` would give it (rank, world
    size; one thread), forked from the server above. The ranks meet through a file (a
    FileStore), not a port picked here that another process could take before rank 0 binds
    it. Fails the test with the output of each rank that did not exit 0 within ``timeout`` s
    (as torchrun does, the first failure stops the others)."""
    common = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    with tempfile.TemporaryDirectory() as logs:
        store = f"file://{os.path.join(logs, 'store')}"
        ranks = []
        for rank in range(world):
            env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            log = os.path.join(logs, f"rank{rank}.log")
            ranks.append(_RANKS.Process(target=_rank, args=(script, list(args), env, store, log)))
            ranks[-1].start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in ranks) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in ranks):
                    break
                time.sleep(0.05)
        finally:
            for proc in ranks:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        failed = [r for r, proc in enumerate(ranks) if proc.exitcode != 0]
        report = [
            f"--- rank {rank} (exit {ranks[rank].exitcode}):\n"
            + Path(logs, f"rank{rank}.log").read_text()[-4000:]
            for rank in failed
        ]
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
