"""Run a function on N local processes joined in a process group, with a deadline.

Used by the benchmark and the tests. Results come back through files (not a
pipe), so a large result can never deadlock a join.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, start_processes

__all__ = ["exit_without_finalizing", "spawn"]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    timeout: float,
    out_dir: str,
    threads: int,
    device: str,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # The ranks meet through a file in the run's own folder (a FileStore): no port to pick,
    # so none that another process can take between the pick and rank 0's bind.
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{os.path.join(out_dir, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_without_finalizing()


def exit_without_finalizing(code: int = 0) -> None:
    """End this process at once, once its results are on disk and its groups destroyed.

    Why not return normally: gloo's worker threads outlive ``destroy_process_group()``
    (``ProcessGroupGloo.shutdown`` is a no-op, and the group object lives as long as
    anything references it: a DDP reducer, an FSDP state, a device mesh). After a
    collective completes and wakes the caller, its worker thread still drops the work's
    last references: the future's Python callbacks and tensors, which needs the GIL.
    If the main thread has meanwhile reached interpreter finalization, Python ends that
    thread with ``pthread_exit``; the forced unwind meets a ``noexcept`` C++ frame and
    calls ``std::terminate``: "terminate called without an active exception", SIGABRT,
    after a run that succeeded. Load makes it likely (the worker thread is descheduled
    right after the wake-up). ``os._exit`` skips finalization, so no thread can race it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    device: str = "cpu",
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    Each process joins a group met through a file (the default group, which ``fn`` may use
    freely): gloo, or with ``device="cuda"`` NCCL, rank ``r`` on GPU ``r`` (modulo the
    GPUs there are; NCCL refuses two ranks on one GPU). ``fn`` must be importable by
    module name. ``start_method``: ``"spawn"`` (a fresh interpreter per rank) or
    ``"forkserver"`` (forked from multiprocessing's fork server: what it preloads, such as
    torch, is imported once, not once per rank; the tests use it).

    Returns:
        The value each rank returned, indexed by rank.

    Raises:
        TimeoutError: not every rank finished within ``timeout`` seconds (all
            are killed first).
        torch.multiprocessing.ProcessRaisedException: a rank raised; the
            message carries its traceback.
    """
    with tempfile.TemporaryDirectory(prefix="rlwire-spawn-") as out_dir:
        # With join=False, start_processes returns the ProcessContext to poll.
        ctx: ProcessContext = start_processes(  # type: ignore[no-untyped-call]  # torch: untyped
            _entry,
            args=(fn, world_size, timeout, out_dir, threads, device, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks did not "
                        f"finish within {timeout:g} s"
                    )
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size)]
