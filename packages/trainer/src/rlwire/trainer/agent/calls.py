"""A user's function (a tool, an environment's step) called in a thread of its own, waited for
with a timeout, and stopped when it is past its time.

Why a thread each: a function that blocks (a sync tool, or an async tool that calls
``time.sleep``) holds only its own thread, never another call or the rollout. Why stopping:
a thread past its time would otherwise run on for the rest of the run, holding whatever it
holds. Python cannot kill a thread; :meth:`Call.stop` does what it can:

- an async function runs in an event loop of its own in that thread: its task is
  cancelled (``CancelledError`` at its current ``await``);
- either way :class:`CallStopped` is raised in the thread
  (``PyThreadState_SetAsyncExc``): Python code stops at its next bytecode; a thread blocked
  inside one C call (``time.sleep``, a socket read) stops when that call returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Call", "CallStopped"]


class CallStopped(BaseException):
    """Raised inside a call's thread when it is stopped past its time (a ``BaseException``,
    so that a tool's ``except Exception`` does not swallow it)."""


class Call:
    """``fn(*args, **kwargs)`` in a daemon thread named ``name``, started at once; async
    functions run to completion in an event loop of the thread's own."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str, **kwargs: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        """Done (result None) when the call ended: what an event loop awaits
        (``asyncio.wrap_future``), instead of a thread that waits."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._lock = threading.Lock()
        """Held by :meth:`stop` while it decides and injects, and by the thread as it
        begins and as it leaves the call: an exception is injected only while the thread
        is still inside this call (never into a thread that ended and whose id was reused)."""
        self._running = False  # the thread is inside the call: stop() may inject into it
        self._stopping = False  # stop() was called (a call not yet begun never begins)
        self._thread = threading.Thread(
            target=self._guarded, args=(fn, args, kwargs), name=name, daemon=True
        )
        self._thread.start()

    def _guarded(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        with contextlib.suppress(CallStopped):  # raised past the call's end: nothing to report
            self._run(fn, args, kwargs)

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """The thread: the call, then its end. A :class:`CallStopped` that :meth:`stop`
        injected lands at any bytecode until the thread left the call (under the lock), so
        every step up to there expects one; the future is resolved whatever happens."""
        try:
            try:
                try:
                    with self._lock:
                        self._running = not self._stopping
                    if not self._running:
                        raise CallStopped  # stopped before it began
                    if inspect.iscoroutinefunction(fn):
                        self.value = asyncio.run(self._main(fn(*args, **kwargs)))
                    else:
                        self.value = fn(*args, **kwargs)
                except CallStopped:
                    self.error = CallStopped("stopped past its time")
                except BaseException as err:  # noqa: BLE001 - the caller reads it
                    self.error = err
                finally:
                    # Leave the call: no stop() injects from here, and one injected before
                    # is cleared, or caught where it lands first. Inline, not a method: one
                    # landing as a method begins would skip it.
                    while True:
                        try:
                            with self._lock:
                                self._running = False
                                _set_async_exc(threading.get_ident(), None)
                            break
                        except CallStopped:
                            continue
            except CallStopped:  # landed in a handler above: the call was stopped
                if self.error is None:
                    self.error = CallStopped("stopped past its time")
        finally:
            try:
                self._done.set()
            finally:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    self.future.set_result(None)  # (InvalidStateError: a waiter cancelled it)

    async def _main(self, coro) -> Any:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.ensure_future(coro)
        return await self._task

    def wait(self, timeout: float) -> bool:
        """Whether the call ended within ``timeout`` seconds (then ``value`` or ``error``)."""
        return self._done.wait(max(0.0, timeout))

    def done(self) -> bool:
        return self._done.is_set()

    def stop(self) -> None:
        """Stop a call that is past its time (see the module docstring); returns at once.
        Nothing is injected once the call's thread left it (under the lock it leaves by)."""
        with self._lock:
            self._stopping = True
            if not self._running:  # not begun (it never will) or left: nothing to stop
                return
            loop, task = self._loop, self._task
            if loop is not None and task is not None:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # its loop closed meanwhile: the call ended
                    return
            ident = self._thread.ident
            assert ident is not None  # started, and running the call
            _set_async_exc(ident, CallStopped)

    def alive(self) -> bool:
        """Whether the thread still runs (a stopped call blocked in a C call, until it returns)."""
        return self._thread.is_alive()


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> int:
    """Raise ``exc`` in thread ``ident`` at its next bytecode, or (None) clear one pending
    there; how many threads it reached."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc)
    )
