"""The bucket pipeline shared by the packing backends: chunking, checksums, deltas, views."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import torch

from ._base import CheckpointEngine, TransferStats, Weights
from ._delta import Delta, pack
from ._delta_batch import DeltaBatch, Encoded
from ._errors import CheckpointEngineError
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

__all__ = ["BucketedEngine"]


DELTA_FLUSH = 8
"""A delta bucket is sent once it stands for this share of a bucket of model bytes
(its payload is far smaller), so that receivers apply while the sender compares."""


class BucketedEngine(CheckpointEngine):
    """A backend that moves fixed-size byte buckets through two reusable slots.

    Subclasses provide the slots and four transport steps; the packing,
    chunking, checksums, deltas, view lifetimes and ordering live here once. A
    subclass that sets ``supports_delta`` also provides
    ``async _exchange_held(held: int | None) -> list[int | None]``: every member says
    which version it holds (receivers their ``base_version``, the master None) and the
    master gets the receivers' answers in rank order. It runs only when the group's
    ``delta`` is on, which only such a subclass accepts.
    """

    slots: list[torch.Tensor]

    if TYPE_CHECKING:  # for the checker only: __init_subclass__ must not find it on the class

        async def _exchange_held(self, held: int | None) -> list[int | None]: ...

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.supports_delta and not hasattr(cls, "_exchange_held"):
            raise TypeError(
                f"{cls.__name__} sets supports_delta but has no _exchange_held, the version "
                "exchange that delta updates need"
            )

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

    async def _send(self, weights: Weights, version: int) -> TransferStats:
        base = None
        start = time.perf_counter()
        try:
            if self._exchange:
                held = await self._exchange_held(None)
                base = self.delta.base_for(held) if self.delta.enabled else None
            stats = await self._pack_and_send(weights, version, base)
        except BaseException:
            self.delta.invalidate()
            raise
        if self.delta.enabled:
            assert stats.wire_bytes is not None  # TransferStats.__post_init__ fills it in
            self.delta.finish(
                version,
                wire=stats.wire_bytes,
                dense=stats.bytes,
                seconds=time.perf_counter() - start,
                was_delta=base is not None,
            )
        if self.delta.reason is not None:
            stats = dataclasses.replace(stats, delta_reason=self.delta.reason)
        return stats

    async def _pack_and_send(
        self, weights: Weights, version: int, base: int | None
    ) -> TransferStats:
        entries: list[Entry] = []
        used = 0
        slot = self._seq % 2  # bucket seq always lives in slot seq % 2, on every member
        nbytes = wire = tensors = buckets = changed = elements = 0
        covered = 0  # model bytes a delta bucket stands for
        packing = 0.0
        await self._acquire(slot, self._seq)

        async def flush(last: bool) -> None:
            nonlocal entries, used, slot, buckets, covered
            covered = 0
            buf = self.slots[slot]
            crc = checksum(buf[:used]) if self.checksum else None
            meta = BucketMeta(self._seq, version, used, last, entries, crc, base)
            await self._emit(slot, meta)
            buckets += 1
            self._seq += 1
            entries, used, slot = [], 0, self._seq % 2
            if not last:
                await self._acquire(slot, self._seq)

        async def pack(src: torch.Tensor, entry: Entry) -> None:
            """Copy ``src`` (bytes) into buckets, one ``entry`` per chunk."""
            nonlocal used, packing
            pos = 0
            for flush_first, offset, length in plan_chunks(used, src.numel(), self.bucket_size):
                if flush_first:
                    await flush(last=False)
                if length:
                    start = time.perf_counter()
                    self.slots[slot][offset : offset + length].copy_(src[pos : pos + length])
                    packing += time.perf_counter() - start
                    used = offset + length
                entries.append(
                    dataclasses.replace(entry, offset=offset, chunk_offset=pos, chunk_nbytes=length)
                )
                pos += length

        batch = DeltaBatch(self.delta)  # a delta bucket's tensors, compared together

        async def send_encoded(done: list[Encoded]) -> None:
            nonlocal changed, wire, covered
            for e in done:
                changed += e.changed
                dname = dtype_name(e.dtype)
                if e.format is None:  # whole (the payload is the tensor, or the mirror's copy)
                    src = as_bytes(e.payload)
                    wire += src.numel()
                    await pack(src, Entry(e.name, dname, e.shape, 0, 0, 0))
                    continue
                info = (e.format, e.changed, e.payload.numel())
                wire += e.payload.numel()
                await pack(e.payload, Entry(e.name, dname, e.shape, 0, 0, 0, None, info))
                covered += e.nbytes
                if covered >= self.bucket_size // DELTA_FLUSH:
                    # receivers apply this part while the rest is compared
                    await flush(last=False)

        async for name, tensor in aiter_weights(weights):
            tensor = tensor.detach().contiguous()  # once: packing and encoding read it
            src = as_bytes(tensor)
            dname, shape = dtype_name(tensor.dtype), tuple(tensor.shape)
            nbytes += src.numel()
            tensors += 1
            elements += tensor.numel()
            start = time.perf_counter()
            given = self._changes is not None and name in self._changes
            if base is not None:
                if given:  # the caller found the changes: no comparison, no mirror
                    assert self._changes is not None
                    fmt, k, payload = self._given(name, tensor, self._changes[name])
                    mine = Encoded(name, fmt, k, payload, tensor.dtype, shape, src.numel())
                    done = [*batch.finish(), mine]  # in sending order
                else:
                    batch.add(name, tensor)
                    full = batch.nbytes >= self.bucket_size // DELTA_FLUSH
                    done = batch.finish() if full else []
                packing += time.perf_counter() - start
                await send_encoded(done)
                continue
            elif self.delta.enabled and not given:
                self.delta.remember(name, tensor)
                packing += time.perf_counter() - start
            wire += src.numel()
            direct = self._in_arena(tensor) if base is None else None
            if direct is not None:  # receivers read it in place: no copy into a slot
                entries.append(Entry(name, dname, shape, direct[1], 0, src.numel(), direct[0]))
                continue
            await pack(src, Entry(name, dname, shape, 0, 0, 0))
        start = time.perf_counter()
        done = batch.finish()
        packing += time.perf_counter() - start
        await send_encoded(done)
        await flush(last=True)
        await self._drain(self._seq - 1)
        return TransferStats(nbytes, tensors, buckets, 0.0, wire, base, changed, elements, packing)

    def _given(
        self, name: str, tensor: torch.Tensor, change: Delta | None
    ) -> tuple[str | None, int, torch.Tensor]:
        """:func:`~._delta.pack` a change the caller gave (``send_weights(changes=)``)."""
        if change is None:
            return None, tensor.numel(), tensor
        if change.shape != tuple(tensor.shape) or change.dtype != tensor.dtype:
            raise CheckpointEngineError(
                f"send_weights(changes=): {name!r} is {tuple(tensor.shape)} {tensor.dtype} but "
                f"its change is for {change.shape} {change.dtype}"
            )
        return pack(tensor, change.positions, change.values, compress=self.delta.compress)

    async def _receive(
        self, copy: bool, base_version: int | None
    ) -> AsyncIterator[tuple[str, torch.Tensor | Delta]]:
        if self._exchange:
            await self._exchange_held(base_version)
        unpacker = Unpacker()
        arenas_read = False
        while True:
            meta, buf = await self._next(self._seq)
            self._seq += 1
            if meta.base is not None and meta.base != base_version:
                raise CheckpointEngineError(
                    f"bucket {meta.index} is a delta from version {meta.base}, but this "
                    f"receiver holds {base_version}"
                )
            arenas_read = arenas_read or any(e.arena is not None for e in meta.entries)
            for name, item, is_view in unpacker.unpack(
                meta, buf, copy=copy, verify=self.checksum, arenas=self._arena
            ):
                yield name, item
                if is_view and not (isinstance(item, torch.Tensor) and self._keeps(item)):
                    # a retained view becomes empty, never silently stale
                    if isinstance(item, Delta):
                        item._release()
                    else:
                        item.set_()  # type: ignore[call-overload]  # stub lacks set_() (empties)
            await self._release(meta)
            if meta.last:
                break
        unpacker.check_complete()
        self.last_version = meta.version
        self._after_receive(meta.version, arenas_read)

    def _keeps(self, item: torch.Tensor) -> bool:
        """Receiver: whether a view ``receive_weights`` yielded stays valid after the next
        item (weights used in place: ``ShmEngine.receive_in_place``)."""
        return False

    def _after_receive(self, version: int, arenas_read: bool) -> None:
        """Receiver: a whole update consumed (``arenas_read``: some of it in the sender's
        shared arenas)."""
