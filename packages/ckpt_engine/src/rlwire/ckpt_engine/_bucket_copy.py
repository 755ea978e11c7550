"""Receiving whole buckets straight into their destinations.

A bucket's tensors are copied from views of its one flat buffer (the sender's slot, mapped
once) into the caller's tensors with one ``torch._foreach_copy_`` per word width, and the
bucket is acknowledged once: on ``cuda_ipc`` the acknowledgement synchronises the stream
once per bucket, so nothing waits on the host per tensor. Chunks of a tensor split over
buckets go straight to their place in the destination (no reassembly buffer). The
functions here run on any device and are tested on CPU over ``shm``;
:meth:`~rlwire.ckpt_engine.backends._cuda_ipc.CudaIpcEngine.receive_into` is their user on
the GPU. Imports the engine's own modules only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import torch

from ._bucketed import BucketedEngine
from ._delta import Delta
from ._errors import CheckpointEngineError
from ._wire import BucketMeta, Entry, Unpacker, as_bytes, dtype_from_name, verify_bucket

__all__ = ["IntoTargets", "ReceiveStats", "batched_copy_", "receive_into", "word_pair"]

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
"""Integer words a byte copy may move as, widest first (wider words: fewer, wider loads)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReceiveStats:
    """What one :func:`receive_into` wrote."""

    version: int
    buckets: int
    tensors: int
    """Names written (whole or by a delta)."""
    bytes: int
    """Bytes copied out of buckets (a delta's payload counts as its payload's bytes)."""
    apply_seconds: float
    """Host time from each bucket's first copy until its acknowledgement returned (on
    ``cuda_ipc`` that includes the bucket's one stream synchronisation, so its copies are
    complete), summed over buckets; waiting for buckets is not counted."""


def word_pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src``, flat ``uint8`` tensors of one length, viewed as the widest
    integer words that both their addresses and their length allow (bit-exact: a copy of
    words is a copy of bytes). Reads addresses only: nothing waits on the device."""
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.dim() != 1 or src.dim() != 1:
        raise CheckpointEngineError(
            f"a bucket copy pairs flat uint8 tensors; got {dst.dtype} {tuple(dst.shape)} and "
            f"{src.dtype} {tuple(src.shape)}"
        )
    n = dst.numel()
    if src.numel() != n:
        raise CheckpointEngineError(f"a bucket copy of {src.numel()} bytes into {n} bytes")
    for width, word in _WORDS:
        if (
            n % width == 0
            and dst.data_ptr() % width == 0
            and src.data_ptr() % width == 0
            and dst.storage_offset() % width == 0  # what view(dtype) itself requires
            and src.storage_offset() % width == 0
        ):
            return dst.view(word), src.view(word)
    raise AssertionError("unreachable: width 1 always fits")


def batched_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i``: flat ``uint8`` tensors, as one
    ``torch._foreach_copy_`` per word width (at most four launches, where a loop over
    tensors is one each). Asynchronous on an accelerator, like ``copy_``: it enqueues on
    the current stream and returns."""
    if len(dsts) != len(srcs):
        raise CheckpointEngineError(f"a bucket copy of {len(srcs)} tensors into {len(dsts)}")
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.numel() == 0 and src.numel() == 0:
            continue
        d, s = word_pair(dst, src)
        group = groups.setdefault(d.dtype, ([], []))
        group[0].append(d)
        group[1].append(s)
    for d_list, s_list in groups.values():
        torch._foreach_copy_(d_list, s_list)


class IntoTargets:
    """One update's buckets written into ``targets`` by name, bucket by bucket.

    A dense chunk becomes a pair (the target's bytes at the chunk's offset, the bucket's
    bytes) for :func:`batched_copy_`; a delta is decoded from the bucket and applied onto
    its target. A name the targets lack, or a target of another shape or dtype or not
    contiguous, is skipped and reported by :meth:`check_complete` (the update is still
    consumed, so the group stays in step), as is a target that did not arrive.

    Args:
        targets: name to destination tensor (contiguous; on the buckets' device for the
            batched route, any other device works through a per-tensor copy).
    """

    def __init__(self, targets: Mapping[str, torch.Tensor]) -> None:
        self.targets = dict(targets)
        self._bytes_in: dict[str, int] = {}
        self.complete: set[str] = set()
        self._unknown: list[str] = []
        self._wrong: dict[str, str] = {}
        self._unpacker = Unpacker()

    def _refused(self, e: Entry) -> bool:
        if e.name in self._wrong or e.name in self._unknown:
            return True
        target = self.targets.get(e.name)
        if target is None:
            self._unknown.append(e.name)
            return True
        dtype = dtype_from_name(e.dtype)
        if tuple(target.shape) != e.shape or target.dtype != dtype:
            self._wrong[e.name] = (
                f"{e.name!r} is {e.shape} {dtype} in the update but {tuple(target.shape)} "
                f"{target.dtype} in the targets"
            )
        elif not target.is_contiguous():
            self._wrong[e.name] = f"the target of {e.name!r} is not contiguous"
        return e.name in self._wrong

    def copies(
        self, meta: BucketMeta, buf: torch.Tensor, arenas: Callable[[int], torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Entry]]:
        """The bucket's dense chunks as ``(destinations, sources)`` of flat ``uint8`` views
        (sources into ``buf`` or a shared arena), and its delta entries."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        deltas: list[Entry] = []
        for e in meta.entries:
            if self._refused(e):
                continue
            if e.delta is not None:
                if e.delta[1] == 0 and e.delta[2] == 0:  # unchanged: nothing to write
                    self.complete.add(e.name)
                else:
                    deltas.append(e)
                continue
            source = buf if e.arena is None else arenas(e.arena)
            if e.chunk_nbytes:
                start = e.chunk_offset
                dsts.append(as_bytes(self.targets[e.name])[start : start + e.chunk_nbytes])
                srcs.append(source[e.offset : e.offset + e.chunk_nbytes])
            have = self._bytes_in.get(e.name, 0) + e.chunk_nbytes
            if have >= e.nbytes:
                self._bytes_in.pop(e.name, None)
                self.complete.add(e.name)
            else:
                self._bytes_in[e.name] = have
        return dsts, srcs, deltas

    def apply_bucket(
        self, meta: BucketMeta, buf: torch.Tensor, arenas: Callable[[int], torch.Tensor]
    ) -> int:
        """Enqueue every write of one bucket; the bytes it copies out of the bucket. The
        caller synchronises (once) before the bucket is reused."""
        dsts, srcs, deltas = self.copies(meta, buf, arenas)
        batched_copy_(dsts, srcs)
        copied = sum(s.numel() for s in srcs)
        if deltas:
            part = dataclasses.replace(meta, entries=deltas, checksum=None)
            for name, item, _ in self._unpacker.unpack(
                part, buf, copy=False, verify=False, arenas=arenas
            ):
                assert isinstance(item, Delta)  # only delta entries were passed
                item.apply_(self.targets[name])
                self.complete.add(name)
            copied += sum(e.chunk_nbytes for e in deltas)
        return copied

    def check_complete(self) -> None:
        """Raises:
        CheckpointEngineError: names the update had and the targets lack, targets that
            did not match, and targets the update did not carry."""
        self._unpacker.check_complete()
        missing = sorted(set(self.targets) - self.complete - set(self._wrong))
        if self._unknown or self._wrong or missing or self._bytes_in:
            wrong = "; ".join(self._wrong[n] for n in sorted(self._wrong))
            raise CheckpointEngineError(
                f"receive_into: the update does not match the targets; unknown names: "
                f"{sorted(self._unknown)}; missing names: {missing}; incomplete: "
                f"{sorted(self._bytes_in)}; mismatched: [{wrong}]"
            )


async def receive_into(
    engine: BucketedEngine,
    targets: Mapping[str, torch.Tensor],
    *,
    base_version: int | None = None,
) -> ReceiveStats:
    """Receive one update of a bucketed ``engine`` into ``targets`` (see
    :meth:`~rlwire.ckpt_engine.backends._cuda_ipc.CudaIpcEngine.receive_into`).

    Raises:
        CheckpointEngineError: as ``receive_weights``; and, once the whole update was
            consumed, names that did not match (:meth:`IntoTargets.check_complete`).
    """
    engine._check_joined("receive_into")
    if base_version is not None and (
        isinstance(base_version, bool) or not isinstance(base_version, int)
    ):
        raise CheckpointEngineError(f"base_version: {base_version!r} is not an int or None")
    if engine.rank == 0:
        raise CheckpointEngineError("receive_into on the master (rank 0)")
    if not engine.active:
        raise CheckpointEngineError("receive_into on an inactive member (rank -1)")
    engine._check_aborted()
    engine.progressed_at = time.monotonic()
    if engine._exchange:
        await engine._exchange_held(base_version)
    into = IntoTargets(targets)
    buckets = copied = 0
    seconds = 0.0
    arenas_read = False
    while True:
        meta, buf = await engine._next(engine._seq)
        engine._seq += 1
        engine.progressed_at = time.monotonic()
        if meta.base is not None and meta.base != base_version:
            raise CheckpointEngineError(
                f"bucket {meta.index} is a delta from version {meta.base}, but this "
                f"receiver holds {base_version}"
            )
        if engine.checksum:
            verify_bucket(meta, buf)
        arenas_read = arenas_read or any(e.arena is not None for e in meta.entries)
        start = time.perf_counter()
        copied += into.apply_bucket(meta, buf, engine._arena)
        await engine._release(meta)  # cuda_ipc: the bucket's one synchronisation, then the ack
        seconds += time.perf_counter() - start
        buckets += 1
        if meta.last:
            break
    into.check_complete()
    engine.last_version = meta.version
    engine._after_receive(meta.version, arenas_read)
    engine.progressed_at = time.monotonic()
    return ReceiveStats(meta.version, buckets, len(into.complete), copied, seconds)
