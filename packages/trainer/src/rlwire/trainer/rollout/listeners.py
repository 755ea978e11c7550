"""Who listens on a TCP port, from Linux's ``/proc``: a server a worker started is sent the
run's token only once the socket listening on its port is known to be that server's (a
process of the tree it started), not a stranger's that bound the port first."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

__all__ = [
    "foreign_listeners",
    "held_sockets",
    "listening_inodes",
    "listening_sockets",
    "process_tree",
]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def listening_sockets(
    proc: Path = Path("/proc"),
) -> dict[int, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """Every listening TCP socket of this network namespace (IPv4 and IPv6): its inode to
    the address and port it listens on."""
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            address, port = fields[1].rsplit(":", 1)
            found[int(fields[9])] = (_address(address), int(port, 16))
    return found


def _address(word: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's hex address: 32-bit words, each in the host's (little-endian) order."""
    raw = bytes.fromhex(word)
    host_order = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(host_order)


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[int]:
    """The socket inodes listening on TCP ``port`` (IPv4 and IPv6, any address)."""
    return {inode for inode, (_, bound) in listening_sockets(proc).items() if bound == port}


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
