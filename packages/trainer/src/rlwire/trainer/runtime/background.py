"""One coroutine at a time on a thread of its own, with an explicit completion method: how an
actor rank sends weights while it goes on training (fully-async mode)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Background", "idle_budget", "wait_moving"]

POLL_S = 1.0
"""How often a wait on a moving transfer looks at its progress."""


def idle_budget(timeout: float) -> float:
    """Seconds a whole transfer may go without progress, for ``ckpt_engine.timeout``
    seconds per wait: two engine waits may lie between two items (a bucket released, the
    next one awaited), and 30 s more for the work between them (copies, the commit)."""
    return 2 * timeout + 30


def wait_moving(
    done: Callable[[float], bool], progressed_at: Callable[[], float | None], idle: float
) -> bool:
    """Wait until ``done(seconds)`` (a bounded wait that says whether it is done) while the
    transfer moves: False once ``idle`` seconds passed without progress (``progressed_at``:
    its ``time.monotonic()``, or None when unknown; this wait's start counts as progress)."""
    last = time.monotonic()
    while True:
        moved = progressed_at()
        if moved is not None:
            last = max(last, moved)
        left = last + idle - time.monotonic()
        if left <= 0:
            return False
        if done(min(POLL_S, left)):
            return True


class Background:
    """Runs one coroutine at a time in a thread with its own event loop.

    :meth:`start` returns at once; :meth:`finish` waits for the coroutine (bounded) and
    returns its result or raises its exception. Starting while one runs finishes that one
    first, so at most one is in flight. Whatever the coroutine reads must not change until
    :meth:`finish` returned (the caller hands it a snapshot).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._thread: threading.Thread | None = None
        self._outcome: tuple[bool, Any] | None = None

    def start(self, make: Callable[[], Coroutine[Any, Any, Any]], *, timeout: float) -> Any:
        """Finish the one in flight (its result is returned, or None), then start ``make()``."""
        before = self.finish(timeout=timeout)

        def target() -> None:
            try:
                self._outcome = (True, asyncio.run(make()))
            except BaseException as err:  # handed to finish(), in the caller's thread
                self._outcome = (False, err)

        self._outcome = None
        self._thread = threading.Thread(target=target, name=f"rlwire-{self.what}", daemon=True)
        self._thread.start()
        return before

    def finish(
        self,
        *,
        timeout: float,
        progressed_at: Callable[[], float | None] | None = None,
        bound: str = "",
    ) -> Any:
        """Wait for the coroutine in flight (None when there is none): its result. With
        ``progressed_at`` (when it last moved, :func:`wait_moving`) ``timeout`` bounds the
        time without progress, not the whole wait. ``bound``: what sets ``timeout``, for
        the error.

        Raises:
            TimeoutError: it did not end within ``timeout`` seconds (without progress).
            Exception: the coroutine's own.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return None

        def ended(seconds: float) -> bool:
            thread.join(seconds)
            return not thread.is_alive()

        if not wait_moving(ended, progressed_at or (lambda: None), timeout):
            self._thread = thread  # still ours: a later finish may wait again
            moved = "made no progress for" if progressed_at else "not finished within"
            raise TimeoutError(f"{self.what}: {moved} {timeout:g} s{bound and f' ({bound})'}")
        assert self._outcome is not None, f"{self.what}: its thread ended without an outcome"
        ok, value = self._outcome
        if not ok:
            raise value
        return value
