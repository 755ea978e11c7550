"""The ``shm`` backend's segment files in ``/dev/shm``, and removing those a killed process
left behind (its own cleanup never ran)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable

__all__ = ["SHM_DIR", "SHM_PREFIX", "mapped_segment_owners", "process_running", "remove_segments"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "rlwire-ckpt-shm-"
"""Every segment's file name starts with this, then the pid of the process that made it, so
that segments an engine killed mid-update left behind can be found and removed."""


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def mapped_segment_owners() -> set[int] | None:
    """The pids of the processes whose ``shm`` segments this process maps now (read from
    ``/proc/self/maps``: a segment stays mapped after its file is unlinked), or None where
    there is no ``/proc``. Which sender a receiver reads from, seen from the kernel's side
    rather than from what the receiver was told."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    owners = set()
    start = f"{SHM_DIR}/{SHM_PREFIX}"
    for line in lines:
        path = line.split(maxsplit=5)[5:]
        if path and path[0].startswith(start):
            pid = path[0][len(start) :].split("-", 1)[0]
            if pid.isdigit():
                owners.add(int(pid))
    return owners


def remove_segments(pids: Iterable[int], *, wait: float = 0.0) -> list[str]:
    """Remove this user's segments made by the processes ``pids`` once they are gone, waiting
    up to ``wait`` seconds in all for them to exit: what engines killed mid-update leave in
    ``/dev/shm`` (an engine unlinks its files once every receiver mapped them, so only a kill
    before that leaves one). A segment of a process still running is kept. Returns the paths
    removed.
    """
    wanted = set(pids)
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []
    deadline = time.monotonic() + wait
    removed = []
    for name in names:
        pid = name[len(SHM_PREFIX) :].split("-", 1)[0] if name.startswith(SHM_PREFIX) else ""
        if not pid.isdigit() or int(pid) not in wanted:
            continue
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_uid != os.getuid():
                continue
            while process_running(int(pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not process_running(int(pid)):
                os.unlink(path)
                removed.append(path)
    return removed
