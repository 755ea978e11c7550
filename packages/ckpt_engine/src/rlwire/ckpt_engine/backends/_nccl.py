"""``nccl``: CUDA buckets broadcast with NCCL in the engine's own group."""

from __future__ import annotations

import asyncio
import datetime
import time

import torch
import torch.distributed as dist

from .._control import StoreControlledEngine, cuda_device
from .._errors import CheckpointEngineTimeout
from .._store import peer_errors
from .._wire import BucketMeta

__all__ = ["NcclEngine"]


class NcclEngine(StoreControlledEngine):
    """Broadcast device buckets from rank 0 over the engine's own ``ProcessGroupNCCL``.

    Metadata and acknowledgements go through the master's store; the bytes
    go through NCCL (which runs on its own stream, ordered after the packing
    copies on the current stream). A receiver yields a bucket only after an
    event recorded behind the broadcast has completed: the data is on its
    device, not merely launched. Every member uses its own two device slots;
    the master reuses one after the broadcast from it finished and every
    receiver acknowledged the bucket.

    Args:
        device: this member's CUDA device (default: the current device).
    """

    name = "nccl"

    def __init__(self, *, device: torch.device | str | None = None, **kwargs) -> None:
        self.device = cuda_device(device, "nccl")
        super().__init__(**kwargs)
        self._pg = None
        self._inflight: list = [None, None]

    def _buffer_device(self) -> torch.device:
        return self.device

    def _allocate(self) -> None:
        self.slots = [
            torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]

    def _create_slots(self) -> dict:
        self._allocate()
        return {}

    def _attach_slots(self, master_metadata: dict) -> None:
        self._allocate()

    def _join(self, rank: int, world_size: int, master_metadata: dict) -> None:
        super()._join(rank, world_size, master_metadata)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=self.timeout)
        with peer_errors("nccl: forming the group", self.timeout):
            self._pg = dist.ProcessGroupNCCL(
                dist.PrefixStore("rlwire-ckpt/nccl", self._store), rank, world_size, options
            )

    def _broadcast(self, tensor: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with torch.cuda.device(self.device):
            return self._pg.broadcast([tensor], opts)

    async def _until_done(self, event: torch.cuda.Event, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not event.query():
            if time.monotonic() > deadline:
                raise CheckpointEngineTimeout(
                    f"nccl: {what}: not complete within {self.timeout:g} s"
                )
            await asyncio.sleep(0.0002)

    async def _acquire(self, slot: int, seq: int) -> None:
        await super()._acquire(slot, seq)
        work, self._inflight[slot] = self._inflight[slot], None
        if work is not None:
            work.wait()  # the current stream (next packing copies) waits for the broadcast

    async def _after_publish(self, slot: int, meta: BucketMeta) -> None:
        if meta.nbytes:
            self._inflight[slot] = self._broadcast(self.slots[slot][: meta.nbytes])

    async def _drain(self, last_seq: int) -> None:
        for slot in range(2):
            work, self._inflight[slot] = self._inflight[slot], None
            if work is not None:
                work.wait()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        await self._until_done(event, "sending the last bucket")
        await super()._drain(last_seq)

    async def _receive_into(self, meta: BucketMeta) -> torch.Tensor:
        buf = self.slots[meta.index % 2]
        if meta.nbytes:
            self._broadcast(buf[: meta.nbytes]).wait()
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            await self._until_done(event, f"receiving bucket {meta.index}")
        return buf

    def finalize(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
        super().finalize()
