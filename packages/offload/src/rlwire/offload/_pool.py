"""Reusable pinned host buffers."""

from __future__ import annotations

import dataclasses
import threading

import torch

from ._transfer import DEFAULT_TIMEOUT_S, wait_event

__all__ = ["PinnedPool", "PoolStats", "default_pool"]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a :class:`PinnedPool`."""

    bytes_pinned: int
    """Host bytes the pool owns (page-locked when ``pinned``), free or in use."""
    bytes_in_use: int
    """Of those, bytes currently handed out (holding offloaded tensors)."""
    allocations: int
    """Host buffers allocated so far (each one a page-locking call)."""
    reuses: int
    """Reservations served from a buffer allocated earlier."""
    pinned: bool
    """Whether the buffers are page-locked (False without an accelerator)."""


def _accelerator_available() -> bool:
    return torch.cuda.is_available()


def _empty_host_cache() -> None:
    """Give torch's caching host allocator's free pinned blocks back to the system."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch: untyped
        empty()


class PinnedPool:
    """Page-locked host buffers that persist across offload/load cycles.

    Page-locking memory is slow (it maps and locks every page) and an offload
    that pins fresh memory every time grows the host footprint. The pool keeps
    every buffer it allocated: :meth:`reserve` hands out the smallest free one
    that is large enough, and :meth:`free` takes it back for the next cycle,
    optionally fenced by the event of a copy still reading it.

    Args:
        pin: page-lock the buffers. ``None`` pins when an accelerator is
            available (pinning needs one), else allocates pageable memory.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = _accelerator_available() if pin is None else pin
        self._lock = threading.Lock()
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._in_use: dict[int, torch.Tensor] = {}
        self._bytes = 0
        self._allocations = 0
        self._reuses = 0

    def reserve(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least ``nbytes`` bytes (1-D ``torch.uint8``, maybe larger).

        Reusing a buffer freed with ``after=`` first waits for that event.

        Raises:
            ValueError: ``nbytes`` is negative or not an int.
            TimeoutError: that event did not complete within the default timeout.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes: {nbytes!r} is not allowed; use an int >= 0")
        with self._lock:
            fitting = [entry for entry in self._free if entry[0].numel() >= nbytes]
            fence = None
            if fitting:
                entry = min(fitting, key=lambda e: e[0].numel())
                self._free.remove(entry)
                block, fence = entry
                self._reuses += 1
            else:
                block = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)
                self._bytes += block.numel()
                self._allocations += 1
            self._in_use[id(block)] = block
        if fence is not None:  # a copy out of this buffer may still run: let it finish
            try:
                wait_event(fence, DEFAULT_TIMEOUT_S, "PinnedPool.reserve: a copy reading a buffer")
            except TimeoutError:
                with self._lock:  # still the pool's, still fenced
                    del self._in_use[id(block)]
                    self._free.append((block, fence))
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
        with self._lock:
            if self._in_use.pop(id(block), None) is None:
                raise ValueError("free: this tensor is not a buffer reserved from this pool")
            self._free.append((block, after))

    def release(self) -> int:
        """Drop the free buffers (unpinning them); buffers in use stay. Returns bytes released."""
        with self._lock:
            dropped, self._free = self._free, []
            released = sum(block.numel() for block, _ in dropped)
            self._bytes -= released
        fences = [fence for _, fence in dropped if fence is not None]
        for fence in fences:  # never unpin memory a copy still reads
            wait_event(fence, DEFAULT_TIMEOUT_S, "PinnedPool.release: a copy reading a buffer")
        if self.pin and dropped:
            dropped.clear()  # the last references: torch's host allocator now caches them
            _empty_host_cache()  # and only this unpins them
        return released

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                bytes_pinned=self._bytes,
                bytes_in_use=sum(b.numel() for b in self._in_use.values()),
                allocations=self._allocations,
                reuses=self._reuses,
                pinned=self.pin,
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
