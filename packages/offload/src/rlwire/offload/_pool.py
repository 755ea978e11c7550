"""Reusable pinned host buffers, allocated on demand or prepared ahead in chunks."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from ._preparation import Preparation
from ._transfer import DEFAULT_TIMEOUT_S, wait_event

__all__ = ["DEFAULT_CHUNK_BYTES", "PinnedPool", "PoolStats", "default_pool", "split_into_chunks"]

logger = logging.getLogger("rlwire.offload")

# The largest buffer an offload packs tensors into (a larger tensor gets a buffer of its
# own size): small enough that page-locking one overlaps the copies into the ones before
# and that best fit wastes little, large enough that per-buffer overheads vanish.
DEFAULT_CHUNK_BYTES = 256 << 20

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a :class:`PinnedPool`."""

    bytes_pinned: int
    """Host bytes the pool owns (page-locked when ``pinned``), free or in use."""
    bytes_in_use: int
    """Of those, bytes currently handed out (holding offloaded tensors)."""
    allocations: int
    """Host buffers allocated so far (each one a page-locking call), prepared ones included."""
    reuses: int
    """Reservations served from a buffer allocated earlier (prepared ahead included)."""
    pinned: bool
    """Whether the buffers are page-locked (False without an accelerator)."""
    buffers: int = 0
    """Host buffers the pool owns now, free or in use."""
    bytes_preparing: int = 0
    """Bytes that preparations still running have yet to allocate."""


def _accelerator_available() -> bool:
    return torch.cuda.is_available()


def _empty_host_cache() -> None:
    """Give torch's caching host allocator's free pinned blocks back to the system."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch: untyped
        empty()


def _page_lock(block: torch.Tensor) -> None:
    """Page-lock ``block``'s exact bytes in place (``cudaHostRegister``).

    Not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds
    every request up to a power of two (a 4.1 GiB slab would lock 8 GiB) and keeps
    freed blocks page-locked until its cache is emptied. torch's own checkpoint
    stager registers pageable storage the same way.

    Raises:
        RuntimeError: the driver refused (the CUDA error code is in the message).
    """
    nbytes = block.numel() * block.element_size()
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch: untyped
    code = int(cudart.cudaHostRegister(block.data_ptr(), nbytes, _REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(f"PinnedPool: page-locking {nbytes} bytes failed (cudaError {code})")


def _page_unlock(ptr: int) -> None:
    """Undo :func:`_page_lock` (``cudaHostUnregister``); never raises (it runs in finalizers)."""
    try:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch: untyped
        code = int(cudart.cudaHostUnregister(ptr))
    except Exception as exc:  # a finalizer must not raise: the memory is freed either way
        logger.debug("rlwire.offload: unlocking host memory at %#x failed: %s", ptr, exc)
        return
    if code != 0:
        logger.debug("rlwire.offload: unlocking host memory at %#x: cudaError %d", ptr, code)


def split_into_chunks(nbytes: int, chunk_bytes: int) -> list[int]:
    """``nbytes`` as buffer sizes of ``chunk_bytes`` each and one remainder (exact, no rounding)."""
    sizes = [chunk_bytes] * (nbytes // chunk_bytes)
    return sizes + [nbytes % chunk_bytes] if nbytes % chunk_bytes else sizes


def _check_nbytes(nbytes: object, what: str = "nbytes") -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{what}: {nbytes!r} is not allowed; use an int >= 0")
    return nbytes


class PinnedPool:
    """Page-locked host buffers that persist across offload/load cycles.

    Page-locking memory is slow (it maps and locks every page: about 1 GB/s,
    against tens of GB/s for the copy itself) and an offload that pins fresh
    memory every time grows the host footprint. The pool keeps every buffer it
    allocated: :meth:`reserve` hands out the smallest free one that is large
    enough (best fit), and :meth:`free` takes it back for the next cycle,
    optionally fenced by the event of a copy still reading it. Buffers have the
    exact size asked for (no rounding up to a power of two).

    The first cycle's page-locking can leave the critical path: :meth:`prepare`
    (or :func:`prepare_model` / :func:`prepare_optimizer`, which know the exact
    buffer sizes an offload will ask for) allocates buffers on a background
    thread, at start-up or while the accelerator computes. An offload packs
    tensors into buffers of at most ``chunk_bytes`` and reserves them one at a
    time, so allocating one overlaps the copies into the ones before.

    Args:
        pin: page-lock the buffers. ``None`` pins when an accelerator is
            available (pinning needs one), else allocates pageable memory.
        chunk_bytes: the largest buffer an offload packs several tensors into
            (a single larger tensor gets a buffer of its own size), and the chunk
            :meth:`prepare` splits a byte count into. Smaller chunks overlap
            page-locking with copying more finely and waste less in best fit;
            larger ones mean fewer buffers (per-buffer overhead, fewer copies
            that end on a buffer boundary).

    Raises:
        ValueError: ``chunk_bytes`` is not an int > 0.
    """

    def __init__(self, *, pin: bool | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: {chunk_bytes!r} is not allowed; use an int > 0")
        self.pin = _accelerator_available() if pin is None else pin
        self.chunk_bytes = chunk_bytes
        self._cond = threading.Condition(threading.Lock())
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._in_use: dict[int, torch.Tensor] = {}
        self._pending: list[int] = []  # sizes running preparations have yet to add
        self._preparations: list[Preparation] = []
        self._unlocks: dict[
            int, weakref.finalize[[int], torch.UntypedStorage]
        ] = {}  # data_ptr -> unlock
        self._bytes = 0
        self._buffers = 0
        self._allocations = 0
        self._reuses = 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A new buffer of exactly ``max(nbytes, 1)`` bytes, page-locked when ``pin``."""
        block = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        if self.pin:
            _page_lock(block)
            # Unlocked by release(), or when the last tensor viewing the memory is gone
            # (the pool dropped while buffers were in use); not at exit: the process's
            # memory goes then anyway, and the driver may already be shut down.
            unlock = weakref.finalize(block.untyped_storage(), _page_unlock, block.data_ptr())
            unlock.atexit = False
            with self._cond:
                self._unlocks[block.data_ptr()] = unlock
        return block

    def _take_best_fit(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        """Remove and return the smallest free buffer of at least ``nbytes`` (under the lock)."""
        fitting = [i for i, (block, _) in enumerate(self._free) if block.numel() >= nbytes]
        if not fitting:
            return None
        # By index: list.remove would compare tensors with ==, elementwise.
        return self._free.pop(min(fitting, key=lambda i: self._free[i][0].numel()))

    def reserve(self, nbytes: int, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> torch.Tensor:
        """A host buffer of at least ``nbytes`` bytes (1-D ``torch.uint8``, maybe larger).

        The smallest free buffer that fits; else, when a running preparation
        will add one that fits, that one (waiting for it); else a new buffer of
        exactly ``nbytes``. Reusing a buffer freed with ``after=`` first waits
        for that event.

        Raises:
            ValueError: ``nbytes`` is negative or not an int.
            TimeoutError: a buffer being prepared, or the event fencing a free
                one, did not come within ``timeout`` seconds (``None``: no limit).
        """
        _check_nbytes(nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                entry = self._take_best_fit(nbytes)
                if entry is not None or not any(size >= nbytes for size in self._pending):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"PinnedPool.reserve: a buffer of {nbytes} bytes being prepared did not "
                        f"come within {timeout:g} s"
                    )
                self._cond.wait(remaining)
            if entry is not None:
                self._reuses += 1
                self._in_use[id(entry[0])] = entry[0]
        if entry is None:  # page-locking is slow: not under the lock
            block = self._allocate(nbytes)
            with self._cond:
                self._bytes += block.numel()
                self._buffers += 1
                self._allocations += 1
                self._in_use[id(block)] = block
            return block
        block, fence = entry
        if fence is not None:  # a copy out of this buffer may still run: let it finish
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                wait_event(fence, remaining, "PinnedPool.reserve: a copy reading a buffer")
            except TimeoutError:
                with self._cond:  # still the pool's, still fenced
                    del self._in_use[id(block)]
                    self._free.append((block, fence))
                    self._cond.notify_all()
                raise
        return block

    def free(self, block: torch.Tensor, *, after: torch.cuda.Event | None = None) -> None:
        """Return a buffer from :meth:`reserve` for reuse.

        Without ``after`` its contents may be overwritten from now on. With
        ``after`` (the event recorded behind an accelerator copy still reading
        the buffer) it is handed out again only once that event completed, so
        a caller that never waits on its copy still returns the buffer.

        Raises:
            ValueError: ``block`` is not a buffer this pool handed out.
        """
        with self._cond:
            if self._in_use.pop(id(block), None) is None:
                raise ValueError("free: this tensor is not a buffer reserved from this pool")
            self._free.append((block, after))
            self._cond.notify_all()

    def prepare(self, nbytes: int | Sequence[int]) -> Preparation:
        """Allocate (and page-lock) free buffers ahead of use, on a background thread.

        Only what the free buffers (and preparations still running) do not
        already cover is allocated, so preparing the same sizes again before
        every offload costs nothing. Prefer :func:`prepare_model` /
        :func:`prepare_optimizer`: they ask for the exact sizes an offload of
        that model will reserve.

        Args:
            nbytes: a byte count (split into buffers of ``chunk_bytes`` and one
                remainder) or the exact size of each buffer.

        Returns:
            A :class:`Preparation`; ``wait()`` on it to have every buffer ready
            (at start-up), or let offloads take them as they come.

        Raises:
            ValueError: a size is negative or not an int.
        """
        if isinstance(nbytes, Sequence):
            sizes = [_check_nbytes(n, "nbytes[]") for n in nbytes]
        else:
            sizes = split_into_chunks(_check_nbytes(nbytes), self.chunk_bytes)
        with self._cond:
            # Best fit of each request, largest first, against what is free or on its way.
            available = sorted([b.numel() for b, _ in self._free] + self._pending)
            covered: list[int] = []
            for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
                fits = [a for a in available if a >= max(sizes[index], 1)]
                if fits:
                    available.remove(fits[0])
                    covered.append(index)
            skip = set(covered)
            needed = [max(size, 1) for i, size in enumerate(sizes) if i not in skip]
            if not needed:
                return Preparation.completed("PinnedPool.prepare")
            preparation = Preparation(needed, what="PinnedPool.prepare")
            self._pending.extend(needed)
            self._preparations.append(preparation)
        thread = threading.Thread(
            target=self._prepare_body,
            args=(preparation,),
            name="rlwire-offload-prepare",
            daemon=True,
        )
        thread.start()
        return preparation

    def _prepare_body(self, preparation: Preparation) -> None:
        began = time.perf_counter()
        error: BaseException | None = None
        left = list(preparation.sizes)
        try:
            while left:
                block = self._allocate(left[0])
                with self._cond:
                    self._pending.remove(left.pop(0))
                    self._free.append((block, None))
                    self._bytes += block.numel()
                    self._buffers += 1
                    self._allocations += 1
                    self._cond.notify_all()
        except BaseException as exc:  # handed to whoever waits on the handle
            error = exc
        finally:
            with self._cond:
                for size in left:  # never coming: a reserve must not wait for them
                    self._pending.remove(size)
                self._preparations.remove(preparation)
                self._cond.notify_all()
            preparation._finish(error, time.perf_counter() - began)

    def release(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> int:
        """Drop the free buffers (unpinning them); buffers in use stay. Returns bytes released.

        Waits for running preparations first (their buffers are released too)
        and for any copy still reading a free buffer.

        Raises:
            TimeoutError: a preparation or a fencing copy did not complete within
                ``timeout`` seconds (``None``: no limit); nothing was released.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        with self._cond:
            running = list(self._preparations)
        for preparation in running:  # its failure is its waiter's business
            if not preparation._finished.wait(remaining()):
                raise TimeoutError(
                    f"PinnedPool.release: {preparation!r} did not complete within {timeout:g} s"
                )
        with self._cond:
            dropped, self._free = self._free, []
        try:
            for _, fence in dropped:  # never unpin memory a copy still reads
                if fence is not None:
                    wait_event(fence, remaining(), "PinnedPool.release: a copy reading a buffer")
        except TimeoutError:
            with self._cond:  # still the pool's, still fenced
                self._free.extend(dropped)
                self._cond.notify_all()
            raise
        with self._cond:
            released = sum(block.numel() for block, _ in dropped)
            self._bytes -= released
            self._buffers -= len(dropped)
            unlocks = [self._unlocks.pop(block.data_ptr(), None) for block, _ in dropped]
        for unlock in unlocks:
            if unlock is not None:
                unlock()  # unlocks now, and never again
        return released

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                bytes_pinned=self._bytes,
                bytes_in_use=sum(b.numel() for b in self._in_use.values()),
                allocations=self._allocations,
                reuses=self._reuses,
                pinned=self.pin,
                buffers=self._buffers,
                bytes_preparing=sum(self._pending),
            )


_default: PinnedPool | None = None
_default_lock = threading.Lock()


def default_pool() -> PinnedPool:
    """The process's default pool, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PinnedPool()
        return _default
