"""The checkpoint-engine interface and the bucket pipeline shared by the packing backends."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any, ClassVar

import torch

from ._errors import CheckpointEngineError
from ._sizes import parse_bucket_size
from ._wire import (
    BucketMeta,
    Entry,
    Unpacker,
    aiter_weights,
    as_bytes,
    checksum,
    dtype_name,
    plan_chunks,
)

__all__ = ["DEFAULT_TIMEOUT_S", "BucketedEngine", "CheckpointEngine", "TransferStats", "Weights"]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds any single wait may block before the engine raises
``CheckpointEngineTimeout`` (per wait, not per update)."""

Weights = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True, slots=True)
class TransferStats:
    """What one ``send_weights`` moved."""

    bytes: int
    tensors: int
    buckets: int
    seconds: float

    @property
    def gbps(self) -> float:
        """GB/s (1e9 bytes per second) over the whole update; 0 for an empty one."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class CheckpointEngine(abc.ABC):
    """One sender (rank 0, ``is_master=True``) and N receivers moving weight updates.

    Lifecycle on every member: ``prepare()`` (allocate; the master's returned
    metadata goes to everyone), ``init_process_group(rank=..., world_size=...,
    master_metadata=...)``, then per update ``await send_weights(...)`` on the
    master and ``async for name, tensor in receive_weights()`` on receivers,
    and ``finalize()`` at the end. A trainer rank other than the master passes
    ``rank=-1``: its calls are no-ops (``send_weights`` still iterates
    ``weights``, so collective gathers inside a generator keep working).

    The engine builds its own store and process group from the metadata and
    never touches the caller's default ``torch.distributed`` group.

    Args:
        bucket_size: bytes per bucket: an int, a string such as ``"512MiB"`` or
            ``"2GB"``, ``"auto"`` (from free memory), or ``None`` for
            :data:`rlwire.ckpt_engine.DEFAULT_BUCKET_SIZE`. The master's value is the one
            used: receivers take it from its metadata when they join.
        timeout: seconds any wait may block before raising ``CheckpointEngineTimeout``.
        checksum: send a CRC-32 per bucket and verify it on receipt.
        is_master: this member sends.
    """

    name: ClassVar[str] = ""
    # Capabilities, read by callers without building an engine (registry.capabilities):
    device_type: ClassVar[str] = "cpu"
    """Where buckets live, so where ``send_weights`` wants its tensors: ``cpu``, ``cuda``
    or ``npu``."""
    uses_store: ClassVar[bool] = False
    """Receivers connect to a TCP store on the master: pass a ``host`` they can reach."""
    zero_copy: ClassVar[bool] = False
    """``share_weights`` moves the sender's tensors into shared memory once; later updates
    send them without packing and receivers read them in place."""

    def __init__(
        self,
        *,
        bucket_size: int | str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        checksum: bool = False,
        is_master: bool = False,
    ) -> None:
        if not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValueError(f"timeout: {timeout!r} is not allowed; use seconds > 0")
        self.bucket_size = parse_bucket_size(bucket_size, device=self._buffer_device())
        self.timeout = float(timeout)
        self.checksum = bool(checksum)
        self.is_master = bool(is_master)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.last_version: int | None = None

    # --- lifecycle -----------------------------------------------------------------
    def _buffer_device(self) -> torch.device:
        return torch.device("cpu")

    @abc.abstractmethod
    def prepare(self) -> dict:
        """Allocate buffers; return this member's JSON-serialisable metadata."""

    def init_process_group(self, *, rank: int, world_size: int, master_metadata: dict) -> None:
        """Join the engine's own group (rank 0 sends, 1..world_size-1 receive; -1: inactive)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: {world_size!r} is not allowed; use an int >= 1")
        if not isinstance(rank, int) or not -1 <= rank < world_size:
            raise ValueError(f"rank: {rank!r} is not allowed; use -1 or 0..{world_size - 1}")
        if (rank == 0) != self.is_master:
            raise ValueError(
                f"rank {rank} with is_master={self.is_master}: the master is rank 0 and only "
                "rank 0 is the master"
            )
        self.rank, self.world_size = rank, world_size
        if rank > 0 and isinstance(master_metadata, dict):
            # The sender's choice: receivers take the master's bucket size ("auto" measured
            # on each member would disagree; slots must match what is sent).
            self.bucket_size = master_metadata.get("bucket_size", self.bucket_size)
        if rank != -1:
            self._join(rank, world_size, master_metadata)

    @abc.abstractmethod
    def _join(self, rank: int, world_size: int, master_metadata: dict) -> None:
        """Backend-specific: connect to the group."""

    def finalize(self) -> None:
        """Free buffers and tear down the group. Idempotent; subclasses call ``super()``."""
        self.rank = self.world_size = None

    @property
    def active(self) -> bool:
        return self.rank is not None and self.rank >= 0

    def _check_joined(self, what: str) -> None:
        if self.rank is None:
            raise CheckpointEngineError(f"{what} before init_process_group()")

    # --- updates -------------------------------------------------------------------
    async def send_weights(self, weights: Weights, *, version: int) -> TransferStats:
        """Send one update: every ``(name, tensor)`` of ``weights``, any dtype/shape/device.

        Returns when every receiver has consumed the whole update.

        Raises:
            CheckpointEngineError: not the master, a version lower than the
                last one sent, bad items, or a failed peer.
            CheckpointEngineTimeout: a receiver did not keep up within ``timeout``.
        """
        self._check_joined("send_weights")
        if not self.active:
            # Nothing to send, but iterate: a generator that gathers shards
            # collectively needs every trainer rank to take part.
            drained = [None async for _ in aiter_weights(weights)]
            del drained
            return TransferStats(0, 0, 0, 0.0)
        if self.rank != 0:
            raise CheckpointEngineError(f"send_weights on receiver rank {self.rank}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise CheckpointEngineError(f"version: {version!r} is not an int")
        if self.last_version is not None and version < self.last_version:
            raise CheckpointEngineError(
                f"version {version} is lower than the last one sent ({self.last_version})"
            )
        start = time.perf_counter()
        nbytes, tensors, buckets = await self._send(weights, version)
        self.last_version = version
        return TransferStats(nbytes, tensors, buckets, time.perf_counter() - start)

    def receive_weights(self, *, copy: bool = True) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield every ``(name, tensor)`` of the next update, in sending order.

        Lifetime: with ``copy=True`` (default) every tensor is owned by the
        caller. With ``copy=False`` a tensor may be a zero-copy view into the
        engine's receive buffer, valid only until the next item is requested;
        the engine then empties that view (``set_()``), so a consumer that kept
        it sees an empty tensor instead of data a later bucket overwrote. Copy
        what you need (``param.copy_(tensor)``) before asking for the next item.
        ``last_version`` is set once the update has been fully consumed; a
        receiver must consume the whole update.
        """
        self._check_joined("receive_weights")
        if not self.active:
            return _empty()
        if self.rank == 0:
            raise CheckpointEngineError("receive_weights on the master (rank 0)")
        return self._receive(copy)

    @abc.abstractmethod
    async def _send(self, weights: Weights, version: int) -> tuple[int, int, int]:
        """Backend: send; return (bytes, tensors, buckets)."""

    @abc.abstractmethod
    def _receive(self, copy: bool) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Backend: yield one update."""


async def _empty() -> AsyncIterator[tuple[str, torch.Tensor]]:
    return
    yield  # pragma: no cover


class BucketedEngine(CheckpointEngine):
    """A backend that moves fixed-size byte buckets through two reusable slots.

    Subclasses provide the slots and four transport steps; the packing,
    chunking, checksums, view lifetimes and ordering live here once.
    """

    slots: list[torch.Tensor]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._seq = 0  # bucket sequence number, continuing across updates

    @abc.abstractmethod
    async def _acquire(self, slot: int, seq: int) -> None:
        """Sender: wait until ``slot`` may be overwritten (receivers are done with it)."""

    @abc.abstractmethod
    async def _emit(self, slot: int, meta: BucketMeta) -> None:
        """Sender: make ``slot[:meta.nbytes]`` and ``meta`` available to every receiver."""

    @abc.abstractmethod
    async def _drain(self, last_seq: int) -> None:
        """Sender: wait until every receiver has consumed bucket ``last_seq``."""

    @abc.abstractmethod
    async def _next(self, seq: int) -> tuple[BucketMeta, torch.Tensor]:
        """Receiver: the metadata and bytes of bucket ``seq``."""

    @abc.abstractmethod
    async def _release(self, meta: BucketMeta) -> None:
        """Receiver: the consumer is done with this bucket's memory."""

    def _in_arena(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """Sender: ``(arena, byte offset)`` if receivers can read ``tensor`` in place."""
        return None

    def _arena(self, arena: int) -> torch.Tensor:
        """Receiver: the sender's shared arena number ``arena`` as ``uint8``."""
        raise CheckpointEngineError(f"{self.name}: no shared arena {arena}")

    async def _send(self, weights: Weights, version: int) -> tuple[int, int, int]:
        entries: list[Entry] = []
        used = 0
        slot = self._seq % 2  # bucket seq always lives in slot seq % 2, on every member
        nbytes = tensors = buckets = 0
        await self._acquire(slot, self._seq)

        async def flush(last: bool) -> None:
            nonlocal entries, used, slot, buckets
            buf = self.slots[slot]
            crc = checksum(buf[:used]) if self.checksum else None
            await self._emit(slot, BucketMeta(self._seq, version, used, last, entries, crc))
            buckets += 1
            self._seq += 1
            entries, used, slot = [], 0, self._seq % 2
            if not last:
                await self._acquire(slot, self._seq)

        async for name, tensor in aiter_weights(weights):
            src = as_bytes(tensor)
            dname, shape = dtype_name(tensor.dtype), tuple(tensor.shape)
            direct = self._in_arena(tensor)
            if direct is not None:  # receivers read it in place: no copy into a slot
                entries.append(Entry(name, dname, shape, direct[1], 0, src.numel(), direct[0]))
                nbytes += src.numel()
                tensors += 1
                continue
            pos = 0
            for flush_first, offset, length in plan_chunks(used, src.numel(), self.bucket_size):
                if flush_first:
                    await flush(last=False)
                if length:
                    self.slots[slot][offset : offset + length].copy_(src[pos : pos + length])
                    used = offset + length
                entries.append(Entry(name, dname, shape, offset, pos, length))
                pos += length
            nbytes += src.numel()
            tensors += 1
        await flush(last=True)
        await self._drain(self._seq - 1)
        return nbytes, tensors, buckets

    async def _receive(self, copy: bool) -> AsyncIterator[tuple[str, torch.Tensor]]:
        unpacker = Unpacker()
        while True:
            meta, buf = await self._next(self._seq)
            self._seq += 1
            for name, tensor, is_view in unpacker.unpack(
                meta, buf, copy=copy, verify=self.checksum, arenas=self._arena
            ):
                yield name, tensor
                if is_view:
                    tensor.set_()  # a retained view becomes empty, never silently stale
            await self._release(meta)
            if meta.last:
                break
        unpacker.check_complete()
        self.last_version = meta.version
