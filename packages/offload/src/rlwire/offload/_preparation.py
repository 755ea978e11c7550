"""The completion handle of pinned buffers being prepared in the background."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ._transfer import DEFAULT_TIMEOUT_S

__all__ = ["Preparation"]


class Preparation:
    """Handle of host buffers a :class:`PinnedPool` allocates (and page-locks) ahead of use.

    Returned by :meth:`PinnedPool.prepare`, :func:`prepare_model` and
    :func:`prepare_optimizer`. The buffers are allocated one at a time on a
    background thread, and each joins the pool's free buffers as soon as it is
    ready. Waiting is optional: an offload that starts meanwhile takes the
    buffers already prepared and waits (bounded) for the ones still being
    prepared that it can use, instead of page-locking them a second time. Wait
    at start-up to move the whole cost off the first offload.

    Attributes:
        sizes: the bytes of each buffer being prepared (those the pool's free
            buffers did not already cover), in the order they are allocated.
        nbytes: their sum (0 when nothing had to be prepared).
    """

    def __init__(self, sizes: Sequence[int], *, what: str) -> None:
        self.sizes = tuple(sizes)
        self.nbytes = sum(self.sizes)
        self._what = what
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._seconds = 0.0

    @classmethod
    def completed(cls, what: str) -> Preparation:
        """A handle for a preparation that had nothing to do."""
        preparation = cls((), what=what)
        preparation._finish(None, 0.0)
        return preparation

    def _finish(self, error: BaseException | None, seconds: float) -> None:
        self._error = error
        self._seconds = seconds
        self._finished.set()

    def done(self) -> bool:
        """Whether every buffer has been allocated, or the preparation failed (non-blocking)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT_S) -> Preparation:
        """Block until every buffer is allocated and in the pool.

        Raises:
            TimeoutError: not complete within ``timeout`` seconds (``None``: no limit).
            Exception: what allocating a buffer raised (the buffers allocated
                before it stay in the pool).
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"{self._what} ({self.nbytes} bytes in {len(self.sizes)} buffers) did not "
                f"complete within {timeout:g} s"
            )
        if self._error is not None:
            raise self._error
        return self

    @property
    def seconds(self) -> float:
        """Wall-clock seconds the background thread took. Only once :meth:`done`.

        Raises:
            RuntimeError: the preparation has not completed yet.
        """
        if not self.done():
            raise RuntimeError(f"{self._what}: seconds is known only after wait()")
        return self._seconds

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"Preparation({self._what}, {self.nbytes} bytes in {len(self.sizes)}, {state})"
