"""``nccl`` and ``hccl``: device buckets broadcast in the engine's own process group.

One engine, :class:`BroadcastEngine`, parametrised by device type and collective
backend, so that the code that runs on CUDA with NCCL is the code that runs on
Ascend NPUs with HCCL (and, for tests, on the CPU with gloo).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import time
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from .._base import TransferStats, Weights
from .._control import StoreControlledEngine, accelerator_device
from .._delta import Delta
from .._errors import CheckpointEngineError, CheckpointEngineTimeout
from .._store import peer_errors
from .._wire import BucketMeta

__all__ = ["BroadcastEngine", "HcclEngine", "NcclEngine"]


_COLLECTIVES = ("nccl", "hccl", "gloo")


class _Group(Protocol):
    """What is used here of a collective backend's process group: torch's stubs declare
    ``ProcessGroupNCCL`` and ``ProcessGroupGloo`` as bare ``Backend``s without it."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...


class _Marker(Protocol):
    def query(self) -> bool: ...


class _CpuMarker:
    """A completion marker on the CPU: a CPU collective's ``wait()`` returns when it is done."""

    def query(self) -> bool:
        return True


def _new_group(backend: str, store: Store, rank: int, world_size: int, timeout: float) -> _Group:
    """The collective backend's own process group over ``store``."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        # NCCL's watchdog tears the process down when a collective outlives this; our own
        # waits (``timeout``) must fire first, raise, and abort the group instead.
        options._timeout = datetime.timedelta(seconds=2 * timeout + 60)
        nccl = dist.ProcessGroupNCCL(store, rank, world_size, options)
        return nccl  # type: ignore[return-value]  # stub: no collectives (see _Group)
    if backend == "hccl":
        hccl: _Group = dist.ProcessGroupHCCL(  # type: ignore[attr-defined]  # torch_npu adds it
            store, rank, world_size, datetime.timedelta(seconds=2 * timeout + 60)
        )
        return hccl
    if backend == "gloo":
        gloo = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout))
        return gloo  # type: ignore[return-value]  # stub: no collectives (see _Group)
    raise AssertionError(backend)  # checked when the engine is built


class BroadcastEngine(StoreControlledEngine):
    """Broadcast device buckets from rank 0 over the engine's own process group.

    Metadata and acknowledgements go through the master's store; the bytes
    go through the collective backend (which runs on its own stream, ordered
    after the packing copies on the current stream). A receiver yields a bucket
    only after an event recorded behind the broadcast has completed: the data is on
    its device, not merely launched. Every member uses its own two device slots;
    the master reuses one after the broadcast from it finished and every
    receiver acknowledged the bucket. The communicator is created when the
    group forms (bounded by ``timeout``); after any failure the group is
    aborted, never left to the backend's watchdog (whose timeout is set above ours).

    Args:
        device: this member's device (default: the current device of ``device_type``).
        device_type: ``cuda``, ``npu`` or ``cpu`` (default: the class's).
        collective_backend: ``nccl``, ``hccl`` or ``gloo`` (default: the class's).
    """

    name = "broadcast"
    device_type = "cuda"
    collective_backend = "nccl"

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        device_type: str | None = None,
        collective_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.device_type = device_type or type(self).device_type
        self.collective_backend = collective_backend or type(self).collective_backend
        if self.collective_backend not in _COLLECTIVES:
            raise CheckpointEngineError(
                f"collective_backend: {self.collective_backend!r} is not supported; "
                f"use {', '.join(repr(c) for c in _COLLECTIVES)}"
            )
        self.device = accelerator_device(device, self.device_type, self.name)
        super().__init__(**kwargs)
        self._pg: _Group | None = None
        self._inflight: list[dist.Work | None] = [None, None]
        self._failed = False

    @property
    def _module(self) -> ModuleType:
        """``torch.cuda``, ``torch.npu`` or ``torch.cpu``."""
        module: ModuleType = torch.get_device_module(self.device_type)  # untyped before 2.15
        return module

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """A context that makes ``self.device`` current (nothing to do on the CPU)."""
        if self.device_type == "cpu":
            return contextlib.nullcontext()
        context: contextlib.AbstractContextManager[Any] = self._module.device(self.device)
        return context

    def _marker(self) -> _Marker:
        """An event recorded on the current stream, behind the work queued so far."""
        if self.device_type == "cpu":
            return _CpuMarker()
        event = self._module.Event()
        event.record(self._module.current_stream(self.device))
        marker: _Marker = event  # a torch.cuda.Event or torch.npu.Event
        return marker

    def _buffer_device(self) -> torch.device:
        return self.device

    def _allocate(self) -> None:
        self.slots = [
            torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]

    def _create_slots(self) -> dict[str, Any]:
        self._allocate()
        return {}

    def _attach_slots(self, master_metadata: dict[str, Any]) -> None:
        self._allocate()

    def _join(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        super()._join(rank, world_size, master_metadata)
        store = PrefixStore(f"rlwire-ckpt/{self.name}", self._joined_store.raw)
        with peer_errors(f"{self.name}: forming the group", self.timeout):
            self._pg = _new_group(self.collective_backend, store, rank, world_size, self.timeout)
        self._connect()

    def _connect(self) -> None:
        """Create the communicator now, while every member is known to be here, with a
        bounded wait (NCCL and HCCL create it lazily, blocking, at the first collective)."""
        probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._broadcast(probe).wait()
                if self.device_type != "cpu":  # a CPU collective is done when wait() returns
                    self._module.current_stream(self.device).synchronize()
            except BaseException as err:  # reported by the joining thread
                failure.append(err)

        worker = threading.Thread(target=run, name=f"rlwire-{self.name}-connect", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if failure:
            self._abort_group()
            raise CheckpointEngineError(
                f"{self.name}: connecting the group of {self.world_size} failed: {failure[0]}"
            ) from failure[0]
        if worker.is_alive():
            # Stuck creating the communicator: abort it (what unblocks a blocked init)
            # from a thread of its own, so that this error is raised at once either way.
            self._failed = True
            threading.Thread(
                target=self._abort_group, name=f"rlwire-{self.name}-abort", daemon=True
            ).start()
            raise CheckpointEngineTimeout(
                f"{self.name}: connecting the group of {self.world_size}: not done within "
                f"{self.timeout:g} s (a member did not take part)"
            )

    def _abort(self, reason: str) -> None:
        # The store's waits end at once; a collective in flight when the communicator is
        # aborted (NCCL's way to end a blocked wait from another thread).
        super()._abort(reason)
        self._abort_group()

    def _abort_group(self) -> None:
        """After a failure: abort the communicator (pending work would block a shutdown)."""
        self._failed = True
        self._inflight = [None, None]
        if self._pg is not None and hasattr(self._pg, "abort"):
            with contextlib.suppress(Exception):  # already torn down by NCCL itself
                self._pg.abort()

    async def _send(self, weights: Weights, version: int) -> TransferStats:
        try:
            return await super()._send(weights, version)
        except Exception:
            self._abort_group()
            raise

    async def _receive(
        self, copy: bool, base_version: int | None
    ) -> AsyncIterator[tuple[str, torch.Tensor | Delta]]:
        try:
            async for item in super()._receive(copy, base_version):
                yield item
        except Exception:
            self._abort_group()
            raise

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        assert self._pg is not None, f"{self.name}: used before init_process_group()"
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with self._on_device():
            return self._pg.broadcast([tensor], opts)

    async def _until_done(self, event: _Marker, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not event.query():
            if time.monotonic() > deadline:
                raise CheckpointEngineTimeout(
                    f"{self.name}: {what}: not complete within {self.timeout:g} s"
                )
            await asyncio.sleep(0.0002)

    async def _acquire(self, slot: int, seq: int) -> None:
        await super()._acquire(slot, seq)
        work, self._inflight[slot] = self._inflight[slot], None
        if work is not None:
            with peer_errors(f"{self.name}: sending a bucket", self.timeout):
                work.wait()  # the current stream (next packing copies) waits for the broadcast

    async def _after_publish(self, slot: int, meta: BucketMeta) -> None:
        if meta.nbytes:
            self._inflight[slot] = self._broadcast(self.slots[slot][: meta.nbytes])

    async def _drain(self, last_seq: int) -> None:
        for slot in range(2):
            work, self._inflight[slot] = self._inflight[slot], None
            if work is not None:
                with peer_errors(f"{self.name}: sending the last bucket", self.timeout):
                    work.wait()
        await self._until_done(self._marker(), "sending the last bucket")
        await super()._drain(last_seq)

    async def _receive_into(self, meta: BucketMeta) -> torch.Tensor:
        buf = self.slots[meta.index % 2]
        if meta.nbytes:
            with peer_errors(f"{self.name}: receiving bucket {meta.index}", self.timeout):
                self._broadcast(buf[: meta.nbytes]).wait()
            await self._until_done(self._marker(), f"receiving bucket {meta.index}")
        return buf

    def finalize(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and not self._failed and hasattr(pg, "shutdown"):
            pg.shutdown()  # a clean drain: graceful; after a failure _abort_group() already ran
        super().finalize()


class NcclEngine(BroadcastEngine):
    """``nccl``: :class:`BroadcastEngine` on CUDA devices over NCCL."""

    name = "nccl"
    device_type = "cuda"
    collective_backend = "nccl"


class HcclEngine(BroadcastEngine):
    """``hccl``: :class:`BroadcastEngine` on Ascend NPUs over HCCL (needs ``torch_npu``)."""

    name = "hccl"
    device_type = "npu"
    collective_backend = "hccl"

    def __init__(self, **kwargs: Any) -> None:
        _require_torch_npu()
        super().__init__(**kwargs)


def _require_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu and the hccl process group)
    except ImportError as err:
        raise ImportError(
            "the hccl checkpoint engine needs torch_npu (Ascend's PyTorch adapter) matching "
            "your torch version; install it from Ascend's distribution"
        ) from err
