"""``nccl``: CUDA buckets broadcast with NCCL in the engine's own group."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as dist

from .._control import StoreControlledEngine, cuda_device
from .._errors import CheckpointEngineError, CheckpointEngineTimeout
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
    receiver acknowledged the bucket. The communicator is created when the
    group forms (bounded by ``timeout``); after any failure the group is
    aborted, never left to NCCL's watchdog (whose timeout is set above ours).

    Args:
        device: this member's CUDA device (default: the current device).
    """

    name = "nccl"

    def __init__(self, *, device: torch.device | str | None = None, **kwargs) -> None:
        self.device = cuda_device(device, "nccl")
        super().__init__(**kwargs)
        self._pg = None
        self._inflight: list = [None, None]
        self._failed = False

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
        # NCCL's watchdog tears the process down when a collective outlives this; our own
        # waits (``timeout``) must fire first, raise, and abort the group instead.
        options._timeout = datetime.timedelta(seconds=2 * self.timeout + 60)
        with peer_errors("nccl: forming the group", self.timeout):
            self._pg = dist.ProcessGroupNCCL(
                dist.PrefixStore("rlwire-ckpt/nccl", self._store), rank, world_size, options
            )
        self._connect()

    def _connect(self) -> None:
        """Create the communicator now, while every member is known to be here, with a
        bounded wait (NCCL creates it lazily, blocking, at the first collective)."""
        probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._broadcast(probe).wait()
                torch.cuda.current_stream(self.device).synchronize()
            except BaseException as err:  # reported by the joining thread
                failure.append(err)

        worker = threading.Thread(target=run, name="rlwire-nccl-connect", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if failure:
            self._abort()
            raise CheckpointEngineError(
                f"nccl: connecting the group of {self.world_size} failed: {failure[0]}"
            ) from failure[0]
        if worker.is_alive():
            # Stuck creating the communicator: abort it (what unblocks a blocked init)
            # from a thread of its own, so that this error is raised at once either way.
            self._failed = True
            threading.Thread(target=self._abort, name="rlwire-nccl-abort", daemon=True).start()
            raise CheckpointEngineTimeout(
                f"nccl: connecting the group of {self.world_size}: not done within "
                f"{self.timeout:g} s (a member did not take part)"
            )

    def _abort(self) -> None:
        """After a failure: abort the communicator (pending work would block a shutdown)."""
        self._failed = True
        self._inflight = [None, None]
        if self._pg is not None and hasattr(self._pg, "abort"):
            with contextlib.suppress(Exception):  # already torn down by NCCL itself
                self._pg.abort()

    async def _send(self, weights, version: int) -> tuple[int, int, int]:
        try:
            return await super()._send(weights, version)
        except Exception:
            self._abort()
            raise

    async def _receive(self, copy: bool):
        try:
            async for item in super()._receive(copy):
                yield item
        except Exception:
            self._abort()
            raise

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
            with peer_errors("nccl: sending a bucket", self.timeout):
                work.wait()  # the current stream (next packing copies) waits for the broadcast

    async def _after_publish(self, slot: int, meta: BucketMeta) -> None:
        if meta.nbytes:
            self._inflight[slot] = self._broadcast(self.slots[slot][: meta.nbytes])

    async def _drain(self, last_seq: int) -> None:
        for slot in range(2):
            work, self._inflight[slot] = self._inflight[slot], None
            if work is not None:
                with peer_errors("nccl: sending the last bucket", self.timeout):
                    work.wait()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        await self._until_done(event, "sending the last bucket")
        await super()._drain(last_seq)

    async def _receive_into(self, meta: BucketMeta) -> torch.Tensor:
        buf = self.slots[meta.index % 2]
        if meta.nbytes:
            with peer_errors(f"nccl: receiving bucket {meta.index}", self.timeout):
                self._broadcast(buf[: meta.nbytes]).wait()
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            await self._until_done(event, f"receiving bucket {meta.index}")
        return buf

    def finalize(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and not self._failed and hasattr(pg, "shutdown"):
            pg.shutdown()  # a clean drain: graceful; after a failure _abort() already ran
        super().finalize()
