"""Test helper (not a test module): a child process's first line, waited for with a deadline.

A bare ``process.stdout.readline()`` waits forever on a child that hangs, or that dies while
a process of its own still holds the pipe open; this fails by name instead, with the child's
exit status and stderr. (ckpt_engine's tests hold a copy, ``ckpt_engine_pipes.py``: each
package's tests run alone, from their own folder, and import no other package's.)
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time

STDERR_TAIL = 4000
"""Characters of the child's stderr a failure quotes (its end)."""


def first_line(process: subprocess.Popen, what: str, *, timeout: float) -> str:
    """The first line ``process`` writes to its stdout pipe, without the newline.

    Reads the pipe's descriptor a byte at a time, so that nothing after the line leaves the
    pipe (the caller may read on through ``process.stdout``, which must not have been read
    before). ``what`` names the line in a failure's message.

    Raises:
        TimeoutError: no whole line within ``timeout`` s; the child is killed, and the
            message holds its stderr (where ``stderr=subprocess.PIPE``).
        RuntimeError: the child closed its stdout before a whole line (it ended, most
            likely); the message holds its exit status and stderr.
    """
    fd = process.stdout.fileno()
    line = bytearray()
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                process.kill()
                process.wait(timeout=10)
                raise TimeoutError(
                    f"{what}: pid {process.pid} wrote no whole line within {timeout:g} s "
                    f"(killed; so far: {bytes(line)!r}); {_stderr(process)}"
                )
            byte = os.read(fd, 1)
            if byte == b"\n":
                return line.decode()
            if not byte:
                raise RuntimeError(
                    f"{what}: pid {process.pid} closed its stdout before a whole line "
                    f"(so far: {bytes(line)!r}; {_exit(process)}); {_stderr(process)}"
                )
            line += byte


def _exit(process: subprocess.Popen) -> str:
    try:
        return f"exit status {process.wait(timeout=10)}"
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        return "still running 10 s later: killed"


def _stderr(process: subprocess.Popen) -> str:
    """The end of what the child wrote to its stderr pipe (once it has ended: up to 5 s for
    the pipe's end, which a process of its own may hold)."""
    if process.stderr is None:
        return "its stderr is not captured"
    fd = process.stderr.fileno()
    chunks = []
    deadline = time.monotonic() + 5
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0 and selector.select(left):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    text = b"".join(chunks).decode(errors="replace")
    return f"stderr:\n{text[-STDERR_TAIL:]}" if text else "nothing on stderr"
