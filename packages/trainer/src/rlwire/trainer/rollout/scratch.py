"""A process's scratch directory in the temp dir, removed however the process ends.

:meth:`ScratchDir.close` removes it (a rollout engine's ``close``, which the worker calls
before the job ends its process); so does the interpreter's exit and the object's collection
(``weakref.finalize``). A process killed outright (``SIGKILL``, ``ray.kill``, the OOM killer)
runs none of these: the directory's name carries the pid of the process that made it,
``<prefix><pid>-<random>``, and the next :class:`ScratchDir` of that prefix on the host
removes this user's whose process is gone (:func:`sweep`).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path

from rlwire.ckpt_engine import process_running

__all__ = ["ScratchDir", "sweep"]


class ScratchDir:
    """A fresh private directory (mode ``0o700``, ``tempfile.mkdtemp``) named
    ``<prefix><pid>-<random>`` under ``parent`` (the temp dir by default), made after
    :func:`sweep` took what killed processes left there under the same ``prefix``.

    Args:
        prefix: the name's start (``"rlwire-adapters-"``); the same for every process that
            makes such directories, so that each one sweeps the others'.
        parent: where it is made; ``None``: ``tempfile.gettempdir()``.
    """

    def __init__(self, prefix: str, *, parent: str | os.PathLike[str] | None = None) -> None:
        self.swept = sweep(prefix, parent=parent)
        """The directories :func:`sweep` removed before this one was made."""
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
        self._remove = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)

    def close(self) -> None:
        """Remove the directory and everything in it (once; later calls do nothing)."""
        self._remove()

    @property
    def closed(self) -> bool:
        return not self._remove.alive


def sweep(prefix: str, *, parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the directories ``<prefix><pid>-...`` in ``parent`` (the temp dir by default)
    that this user owns and whose process ``pid`` is gone; the paths removed.

    Only real directories (not symlinks) owned by the effective uid are touched. A name
    without a pid (one made before names carried it) is kept: whose it was cannot be told.
    The pid is checked with ``os.kill(pid, 0)``: a pid the kernel reused since keeps its
    directory until that process ends too, and a process of another pid namespace sharing
    this temp dir (a container) would look gone, so give such processes a ``parent`` of
    their own.
    """
    folder = os.fspath(parent) if parent is not None else tempfile.gettempdir()
    me, uid = os.getpid(), os.geteuid()
    removed = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid, dash, _ = entry.name[len(prefix) :].partition("-")
        if not (dash and pid.isdigit()) or int(pid) == me:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # another process swept it meanwhile
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or process_running(int(pid)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed
