"""Who listens on a TCP port, from Linux's ``/proc``: a server a worker started is sent the
run's token only once the socket listening on its port is known to be that server's (a
process of the tree it started), not a stranger's that bound the port first."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["foreign_listeners", "held_sockets", "listening_inodes", "process_tree"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[int]:
    """The socket inodes listening on TCP ``port`` (IPv4 and IPv6, any address)."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(fields[9]))
    return found


def process_tree(root: int, proc: Path = Path("/proc")) -> set[int]:
    """``root`` and every process below it (from each thread's ``children``)."""
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue
        tree.add(pid)
        for task in (proc / str(pid) / "task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return tree


def held_sockets(pids: set[int], proc: Path = Path("/proc")) -> set[int]:
    """The inodes of the sockets the processes ``pids`` hold open."""
    held = set()
    for pid in pids:
        try:
            fds = os.listdir(proc / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(proc / str(pid) / "fd" / fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                held.add(int(target[8:-1]))
    return held


def foreign_listeners(port: int, root: int) -> set[int] | None:
    """The sockets listening on ``port`` that the process tree of ``root`` does not hold
    (empty: only that tree listens there); None where ``/proc`` cannot tell (not Linux)."""
    if not Path("/proc/net/tcp").exists():
        return None
    return listening_inodes(port) - held_sockets(process_tree(root))
