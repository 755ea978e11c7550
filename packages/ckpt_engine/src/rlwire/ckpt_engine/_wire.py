"""The bucket wire format: packing named tensors into byte buckets and back.

A bucket is a byte buffer plus metadata listing, for every tensor chunk in it,
``(name, dtype, shape, offset, chunk_offset, chunk_nbytes)``. Each chunk starts
at a 256-byte aligned offset (so any dtype view of it is aligned). A tensor
larger than the space left is split into chunks over several buckets and
reassembled on the receiver. Only the used bytes of a bucket are sent.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import torch

from ._delta import Delta
from ._delta_batch import DeltaEntry, decode_many
from ._dtypes import WIRE_DTYPES, check_dtype, checked_numel, dtype_name
from ._errors import CheckpointEngineError

__all__ = [
    "ALIGN",
    "BucketMeta",
    "Entry",
    "Unpacker",
    "aiter_weights",
    "as_bytes",
    "checksum",
    "dtype_from_name",
    "dtype_name",
    "plan_chunks",
    "to_bytes",
    "verify_bucket",
]

ALIGN = 256
MAX_DELTA_OVERHEAD = 4096
"""A delta payload is at most twice its tensor's bytes and this (its positions and values
cost less than the dense tensor, or it is sent dense): a larger claim is refused."""
MAX_META_BYTES = 64 << 20
"""Bucket metadata larger than this is refused before it is received (a bucket holding a
million tensors' entries takes about 100 MB less)."""


def dtype_from_name(name: str, what: str = "bucket metadata") -> torch.dtype:
    """The dtype a peer's metadata names: one of :data:`~._dtypes.WIRE_DTYPES`, else
    :class:`CheckpointEngineError` (``what`` says where the name came from)."""
    return check_dtype(name, what)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s data as a flat, contiguous ``uint8`` tensor (a view when possible)."""
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.contiguous().view(-1).view(torch.uint8)


def to_bytes(buf: torch.Tensor) -> bytes:
    """The bytes of a contiguous CPU ``uint8`` tensor."""
    return ctypes.string_at(buf.data_ptr(), buf.numel()) if buf.numel() else b""


def checksum(buf: torch.Tensor) -> int:
    """CRC-32 of a contiguous ``uint8`` tensor's bytes.

    No copy for host memory; an accelerator buffer is first copied to the host
    (ordered after the current stream's work), so checksums on the CUDA
    backends cost one device-to-host copy per bucket on each member.
    """
    if buf.device.type != "cpu":
        buf = buf.cpu()
    n = buf.numel()
    if n == 0:
        return 0
    view = (ctypes.c_char * n).from_address(buf.data_ptr())
    return zlib.crc32(memoryview(view))


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One tensor chunk in a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the chunk in the bucket (256-aligned when non-empty)."""
    chunk_offset: int
    """Byte offset of the chunk within the tensor."""
    chunk_nbytes: int
    arena: int | None = None
    """Set for a tensor read in place from the sender's shared arena number
    ``arena`` (``offset`` is then the byte offset in that arena); such a
    tensor occupies no bucket space."""
    delta: tuple[str, int, int] | None = None
    """Set for a tensor sent as a delta (see ``_delta``): ``(format, changed
    elements, payload bytes)``; the chunks then carry the payload, not the tensor."""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * dtype_from_name(self.dtype).itemsize

    @property
    def payload_nbytes(self) -> int:
        """Bytes that travel for the whole tensor: its delta payload's, or its own."""
        return self.delta[2] if self.delta is not None else self.nbytes


@dataclasses.dataclass(slots=True)
class BucketMeta:
    """Metadata of one bucket, sent ahead of (or beside) its bytes."""

    index: int
    version: int
    nbytes: int
    last: bool
    entries: list[Entry]
    checksum: int | None = None
    base: int | None = None
    """The version the update's delta entries were computed from (None: a dense update)."""

    def to_bytes(self) -> bytes:
        entries = []
        for e in self.entries:
            row = [e.name, e.dtype, list(e.shape), e.offset, e.chunk_offset, e.chunk_nbytes]
            if e.arena is not None or e.delta is not None:
                row.append(e.arena)
            if e.delta is not None:
                row.append(list(e.delta))
            entries.append(row)
        head = [self.index, self.version, self.nbytes, self.last, self.checksum, entries]
        if self.base is not None:
            head.append(self.base)
        return json.dumps(head, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> BucketMeta:
        """The metadata in ``data``, every field's type and range checked.

        Raises:
            CheckpointEngineError: not this format; a size, offset or shape that is
                negative or not an integer; a dtype not in :data:`~._dtypes.WIRE_DTYPES`; a
                shape no tensor has; a chunk past the bucket's bytes (nothing is allocated
                from it before).
        """
        try:
            index, version, nbytes, last, crc, rows, *base = json.loads(data)
            entries = []
            for r in rows:
                arena = r[6] if len(r) > 6 else None
                delta = tuple(r[7]) if len(r) > 7 else None
                entry = Entry(r[0], r[1], tuple(r[2]), r[3], r[4], r[5], arena, delta)
                _check_entry(entry)
                entries.append(entry)
            meta = cls(index, version, nbytes, last, entries, crc, *base)
        except (ValueError, TypeError, IndexError, KeyError) as err:
            raise CheckpointEngineError(f"bucket metadata: malformed ({err})") from None
        for value in (meta.index, meta.version, meta.nbytes):
            _natural(value, "bucket metadata: index, version and size")
        if not isinstance(meta.last, bool) or len(base) > 1:
            raise CheckpointEngineError("bucket metadata: malformed (its header)")
        for optional in (meta.checksum, meta.base):  # compared and printed as ints downstream
            if optional is not None:
                _natural(optional, "bucket metadata: checksum and base version")
        for e in meta.entries:  # a chunk in the bucket lies in its used bytes
            if e.arena is None and e.offset + e.chunk_nbytes > meta.nbytes:
                raise CheckpointEngineError(
                    f"bucket metadata: {e.name!r}: a chunk at bytes {e.offset}-"
                    f"{e.offset + e.chunk_nbytes} of a bucket of {meta.nbytes}"
                )
        return meta


def _natural(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointEngineError(f"{what}: {value!r} is not an integer >= 0")


def _check_entry(e: Entry) -> None:
    """An entry's fields as the sender writes them: a name, a dtype of
    :data:`~._dtypes.WIRE_DTYPES`, a shape a tensor can have (each dimension below 2**63, at
    most 2**63 - 1 bytes), offsets and sizes >= 0, a delta ``(format, changes, bytes)``."""
    if not isinstance(e.name, str) or not isinstance(e.dtype, str):
        raise CheckpointEngineError("bucket metadata: an entry without a name or dtype")
    what = f"bucket metadata: {e.name!r}"
    dtype = dtype_from_name(e.dtype, what)
    for value in (*e.shape, e.offset, e.chunk_offset, e.chunk_nbytes):
        _natural(value, what)
    checked_numel(e.shape, dtype, what)
    if e.arena is not None:
        _natural(e.arena, what)
    if e.delta is not None:
        if len(e.delta) != 3 or not isinstance(e.delta[0], str):
            raise CheckpointEngineError(f"{what}: a malformed delta {e.delta!r}")
        _natural(e.delta[1], what)
        _natural(e.delta[2], what)
        if e.delta[2] > 2 * e.nbytes + MAX_DELTA_OVERHEAD:
            raise CheckpointEngineError(
                f"{what}: a delta payload of {e.delta[2]} bytes for a tensor of {e.nbytes}"
            )
    if e.chunk_offset + e.chunk_nbytes > e.payload_nbytes:
        raise CheckpointEngineError(
            f"{what}: a chunk of bytes {e.chunk_offset}-{e.chunk_offset + e.chunk_nbytes} of "
            f"a payload of {e.payload_nbytes}"
        )


def verify_bucket(meta: BucketMeta, buf: torch.Tensor) -> None:
    """Check a received bucket against the CRC-32 in its metadata (none sent: nothing).

    Raises:
        CheckpointEngineError: the bucket's CRC-32 does not match the sender's.
    """
    if meta.checksum is None:
        return
    actual = checksum(buf[: meta.nbytes])
    if actual != meta.checksum:
        names = sorted({e.name for e in meta.entries})
        raise CheckpointEngineError(
            f"bucket {meta.index} of version {meta.version} is corrupted: checksum "
            f"{actual:#010x} != {meta.checksum:#010x}; tensors: {names}"
        )


def plan_chunks(used: int, nbytes: int, bucket_size: int) -> Iterator[tuple[int, int, int]]:
    """Where a tensor of ``nbytes`` goes, starting in a bucket that has ``used`` bytes.

    Yields ``(flush_before, offset, length)``: whether to send the current
    bucket first, the chunk's offset in the bucket and its length.
    """
    if nbytes == 0:
        yield False, used, 0
        return
    pos = 0
    while True:
        offset = -(-used // ALIGN) * ALIGN
        flush = offset >= bucket_size or (
            offset > 0 and offset + (nbytes - pos) > bucket_size and nbytes - pos <= bucket_size
        )
        if flush:
            offset, used = 0, 0
        length = min(nbytes - pos, bucket_size - offset)
        yield flush, offset, length
        pos += length
        used = offset + length
        if pos >= nbytes:
            return


class Unpacker:
    """Receiver side: turns buckets back into ``(name, tensor)`` in sending order.

    A delta entry becomes a :class:`~rlwire.ckpt_engine._delta.Delta` instead of a tensor.
    """

    def __init__(self) -> None:
        self._partial: dict[str, tuple[list[torch.Tensor], int]] = {}

    def unpack(
        self,
        meta: BucketMeta,
        buf: torch.Tensor,
        *,
        copy: bool,
        verify: bool,
        arenas: Callable[[int], torch.Tensor] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | Delta, bool]]:
        """Yield ``(name, tensor or delta, is_view)`` for every tensor completed by this bucket.

        ``is_view`` items alias ``buf`` (or a shared arena, via ``arenas``);
        the others are owned (reassembled chunks, copies, empty tensors).

        Raises:
            CheckpointEngineError: the bucket's checksum does not match.
        """
        if verify:
            verify_bucket(meta, buf)
        deltas = self._deltas(meta, buf, copy, arenas)  # checked before any item is given
        for i, e in enumerate(meta.entries):
            dtype = dtype_from_name(e.dtype)
            if e.delta is not None:
                if i in deltas:
                    yield e.name, *deltas[i]
                continue
            if e.nbytes == 0:
                yield e.name, torch.empty(e.shape, dtype=dtype, device=buf.device), False
                continue
            whole = self._assemble(e, buf, copy, arenas)
            if whole is not None:
                data, is_view = whole
                yield e.name, data.view(dtype).view(e.shape), is_view

    def _deltas(
        self,
        meta: BucketMeta,
        buf: torch.Tensor,
        copy: bool,
        arenas: Callable[[int], torch.Tensor] | None,
    ) -> dict[int, tuple[Delta, bool]]:
        """The deltas this bucket completes, decoded together, by entry index."""
        at: list[tuple[int, bool]] = []
        found: list[DeltaEntry] = []
        for i, e in enumerate(meta.entries):
            if e.delta is None:
                continue
            whole = self._assemble(e, buf, copy, arenas)
            if whole is not None:
                at.append((i, whole[1]))
                found.append((e.delta[0], e.delta[1], e.shape, dtype_from_name(e.dtype), whole[0]))
        decoded = decode_many(found)
        return {i: (d, is_view) for (i, is_view), d in zip(at, decoded, strict=True)}

    def _assemble(
        self,
        e: Entry,
        buf: torch.Tensor,
        copy: bool,
        arenas: Callable[[int], torch.Tensor] | None,
    ) -> tuple[torch.Tensor, bool] | None:
        """The entry's whole ``uint8`` payload and whether it is a view, or None until its
        last chunk has arrived."""
        source = buf
        if e.arena is not None:
            if arenas is None:
                raise CheckpointEngineError(
                    f"{e.name!r} refers to a shared arena this backend does not have"
                )
            source = arenas(e.arena)
        if e.offset + e.chunk_nbytes > source.numel():  # the metadata's own ranges: from_bytes
            raise CheckpointEngineError(
                f"{e.name!r}: a chunk at bytes {e.offset}-{e.offset + e.chunk_nbytes} of a "
                f"{'shared arena' if e.arena is not None else 'bucket'} of {source.numel()}"
            )
        chunk = source[e.offset : e.offset + e.chunk_nbytes]
        total = e.payload_nbytes
        parts, have = self._partial.get(e.name, ([], 0))
        if e.chunk_offset != have:  # chunks come in order: no overlap, no gap
            raise CheckpointEngineError(
                f"{e.name!r}: a chunk at byte {e.chunk_offset} where byte {have} comes next "
                "(chunks that overlap or leave a gap)"
            )
        if e.chunk_offset == 0 and e.chunk_nbytes == total:
            return (chunk.clone(), False) if copy else (chunk, True)
        # kept as they come and joined once all are here: nothing is allocated from the
        # size the metadata claims, only for the bytes that arrived
        parts = [*parts, chunk.clone()]
        have += e.chunk_nbytes
        if have < total:
            self._partial[e.name] = (parts, have)
            return None
        self._partial.pop(e.name, None)
        return torch.cat(parts), False

    def check_complete(self) -> None:
        if self._partial:
            raise CheckpointEngineError(
                f"update ended with incomplete tensors: {sorted(self._partial)}"
            )


async def aiter_weights(
    weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Iterate a sync or async iterable of ``(name, tensor)`` asynchronously, checking items."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield _checked(item)
    else:
        for item in weights:
            yield _checked(item)


def _checked(item: Any) -> tuple[str, torch.Tensor]:
    try:
        name, tensor = item
    except (TypeError, ValueError):
        raise CheckpointEngineError(
            f"weights must yield (name, tensor) pairs; got {type(item).__name__}"
        ) from None
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise CheckpointEngineError(
            f"weights must yield (str, torch.Tensor) pairs; got ({type(name).__name__}, "
            f"{type(tensor).__name__})"
        )
    if tensor.dtype not in _SENT:  # refused here, not by every receiver
        check_dtype(dtype_name(tensor.dtype), f"weights: {name!r}")
    return name, tensor


_SENT = frozenset(WIRE_DTYPES.values())
