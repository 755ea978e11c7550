"""The completion handle of one offload or load."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["DEFAULT_TIMEOUT_S", "Transfer", "wait_event"]

# How long wait() blocks by default before raising: far beyond any real copy
# (minutes at PCIe speed for hundreds of GB), short of a silent hang.
DEFAULT_TIMEOUT_S = 600.0


def wait_event(event: torch.cuda.Event, timeout: float | None, what: str) -> None:
    """Block until ``event`` completed (polling, so the wait is bounded).

    Raises:
        TimeoutError: not complete within ``timeout`` seconds (``None``: no limit).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while not event.query():  # type: ignore[no-untyped-call]  # torch: untyped
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete within {timeout:g} s")
        time.sleep(0.0002)


class Transfer:
    """Handle of a (possibly still running) copy between accelerator and host.

    Contract: until :meth:`wait` returns (or :meth:`done` returns True), the
    destination memory is not safe to read on the host, and a host buffer
    that is the *source* of a load must not be written. Consumers on another
    accelerator stream order themselves after the copy with
    :meth:`wait_stream` (or by waiting on :attr:`event`) without blocking the
    host. A load already makes the current stream wait, so ordinary use of
    the loaded model on the current stream is safe at once.

    Attributes:
        nbytes: bytes moved (0 for a no-op, e.g. on a machine without an accelerator).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        what: str,
        start: torch.cuda.Event | None = None,
        end: torch.cuda.Event | None = None,
        host_seconds: float | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.nbytes = nbytes
        self._what = what
        self._start = start
        self._end = end
        self._host_seconds = host_seconds
        self._completed = end is None
        self._on_done = on_done
        if self._completed:
            self._finished()

    @classmethod
    def completed(cls, what: str, nbytes: int = 0, seconds: float = 0.0) -> Transfer:
        """A handle for work that finished synchronously."""
        return cls(nbytes, what=what, host_seconds=seconds)

    @property
    def event(self) -> torch.cuda.Event | None:
        """The event recorded after the last copy (``None`` for synchronous work)."""
        return self._end

    def _finished(self) -> None:
        """Mark complete and run ``on_done`` once (it may free what the copy fenced)."""
        self._completed = True
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()

    def done(self) -> bool:
        """Whether the copy has completed (non-blocking)."""
        if self._completed or self._end is None:
            return self._completed
        if self._end.query():  # type: ignore[no-untyped-call]  # torch: untyped
            self._finished()
        return self._completed

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT_S) -> Transfer:
        """Block until the copy is complete and host memory is safe to read.

        Raises:
            TimeoutError: not complete within ``timeout`` seconds (``None``: no limit).
        """
        if not self.done():
            assert self._end is not None  # a handle without an end event is born done
            wait_event(self._end, timeout, f"{self._what} ({self.nbytes} bytes)")
            self._finished()
        return self

    def wait_stream(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream``'s later work wait for this copy, without blocking the host."""
        if self._end is not None:
            stream.wait_event(self._end)

    @property
    def seconds(self) -> float:
        """Duration of the copy (device time between its events). Only after :meth:`wait`.

        Raises:
            RuntimeError: the transfer has not completed yet.
        """
        if not self.done():
            raise RuntimeError(f"{self._what}: seconds is known only after wait()")
        if self._start is not None and self._end is not None:
            milliseconds: float = self._start.elapsed_time(self._end)
            return milliseconds / 1000.0
        return self._host_seconds or 0.0

    @property
    def gbps(self) -> float:
        """Bytes moved per second, in GB/s (1e9). Only after :meth:`wait`; 0 for a no-op."""
        seconds = self.seconds
        return self.nbytes / seconds / 1e9 if seconds > 0 else 0.0

    def __repr__(self) -> str:
        state = "done" if self._completed else "in flight"
        return f"Transfer({self._what}, {self.nbytes} bytes, {state})"
