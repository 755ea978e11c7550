"""One receiver process of ``python -m rlwire.ckpt_engine.bench``: its engine, its
destination tensors, and the commands it takes from the bench (apply, consume, memory,
crc); the engine options and devices both sides share. Imports the library only.

A ``cuda_ipc`` receiver applies with :meth:`CudaIpcEngine.receive_into` (per bucket: one
batched copy out of the mapped slot, one stream synchronisation); the others copy each
item ``receive_weights(copy=False)`` yields, synchronising the device after each (the CPU
backends' synchronisation is a no-op)."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from multiprocessing.queues import Queue
from typing import Any

import torch

from ._delta import Delta
from ._registry import registry
from ._shapes import Layout
from ._wire import as_bytes, checksum
from .backends._cuda_ipc import CudaIpcEngine

__all__ = ["CUDA_BACKENDS", "allocate", "crc", "device_for", "options", "receiver", "sync"]

CUDA_BACKENDS = ("cuda_ipc", "nccl")


def device_for(backend: str, rank: int) -> torch.device:
    if backend not in CUDA_BACKENDS:
        return torch.device("cpu")
    # nccl: one GPU per member; cuda_ipc: everyone on the master's GPU
    index = rank % torch.cuda.device_count() if backend == "nccl" else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocate(layout: Layout, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape, dtype in layout}


def crc(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(checksum(as_bytes(t.cpu())) for t in tensors.values())


def _private_bytes() -> int:
    """This process's anonymous plus shared-memory resident bytes (``/proc/self/status``)."""
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


class _PeakSampler:
    """The peak of :func:`_private_bytes` while active, sampled every millisecond."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _private_bytes())
            time.sleep(0.001)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _private_bytes())


def options(
    args: argparse.Namespace, row: dict[str, Any], master: bool, root: str
) -> dict[str, Any]:
    backend = row["backend"]
    options = {"bucket_size": args.bucket_size, "timeout": args.timeout, "is_master": master}
    if row["delta"]:
        options["delta"] = "on"
        options["compress"] = row.get("compress", "off")
    if backend == "filesystem":
        options["root"] = root
    return options


def receiver(
    rank: int,
    args: argparse.Namespace,
    row: dict[str, Any],
    layout: Layout,
    root: str,
    meta_q: Queue[dict[str, Any]],
    cmd_q: Queue[str | None],
    done_q: Queue[tuple[Any, ...]],
) -> None:
    torch.set_num_threads(args.threads)
    device = device_for(row["backend"], rank)
    dest = allocate(layout, device)  # touched (zeroed): part of the baseline
    baseline = _private_bytes()
    engine = registry.new(row["backend"], **options(args, row, False, root))
    engine.prepare()
    meta = meta_q.get(timeout=args.timeout)
    engine.init_process_group(rank=rank, world_size=args.receivers + 1, master_metadata=meta)
    held: int | None = None

    async def update(write: bool) -> float:
        nonlocal held
        if row.get("in_place"):  # the arena's tensors become the weights: a swap each
            got, version = await engine.receive_in_place()  # type: ignore[attr-defined]
            start = time.perf_counter()
            dest.update(got)
            engine.released(version)  # type: ignore[attr-defined]
            return time.perf_counter() - start
        spent = 0.0
        base = held if row["delta"] else None
        if write and isinstance(engine, CudaIpcEngine):
            # per bucket: one batched copy out of the mapped slot, one synchronisation
            stats = await engine.receive_into(dest, base_version=base)
            held = engine.last_version
            return stats.apply_seconds
        async for name, item in engine.receive_weights(copy=False, base_version=base):
            if write:
                start = time.perf_counter()
                if isinstance(item, Delta):
                    item.apply_(dest[name])
                else:
                    dest[name].copy_(item)
                sync(device)
                spent += time.perf_counter() - start
        held = engine.last_version if write else None
        return spent

    for command in iter(cmd_q.get, None):
        if command == "crc":
            done_q.put((rank, crc(dest)))
            continue
        if command == "memory":
            with _PeakSampler() as sampler:
                asyncio.run(update(True))
            arena = sum(t.numel() for t in getattr(engine, "_mapped", {}).values())
            done_q.put((rank, time.monotonic(), sampler.peak - baseline - arena))
            continue
        spent = asyncio.run(update(command == "apply"))
        done_q.put((rank, time.monotonic(), spent))
    engine.finalize()
