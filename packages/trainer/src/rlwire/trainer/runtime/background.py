"""One coroutine at a time on a thread of its own, with an explicit completion method: how an
actor rank sends weights while it goes on training (fully-async mode)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Background"]


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

    def finish(self, *, timeout: float) -> Any:
        """Wait for the coroutine in flight (None when there is none): its result.

        Raises:
            TimeoutError: it did not end within ``timeout`` seconds.
            Exception: the coroutine's own.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join(timeout)
        if thread.is_alive():
            self._thread = thread  # still ours: a later finish may wait again
            raise TimeoutError(f"{self.what}: not finished within {timeout:g} s")
        assert self._outcome is not None, f"{self.what}: its thread ended without an outcome"
        ok, value = self._outcome
        if not ok:
            raise value
        return value
