"""Set once for every test module here: what multiprocessing's fork server preloads.

test_ckpt_engine_transfer.py forks its group members from multiprocessing's fork server,
which imports torch and the worker module once.
"""

from __future__ import annotations

import multiprocessing


def _preload_in_fork_server(*modules: str) -> None:
    """Add ``modules`` to what multiprocessing's fork server imports before it forks a child.

    The server is one per process (started by the first child any test asks of it) and
    imports one list, which ``set_forkserver_preload`` replaces: with each package's tests
    setting their own, the last conftest pytest loaded would decide for all. So each adds its
    modules to the list set so far and sets the union, sorted: the same list whatever the
    order, alone or in the workspace's run. A module the server cannot import (another
    package's helper off its path, an optional library missing) is skipped by the server, and
    a child imports what its server lacks: only start-up time depends on the list.
    """
    from multiprocessing import forkserver

    # What is set so far: multiprocessing has no getter. Its default, "__main__", would
    # import pytest's entry point in the server; no list here asks for it.
    current = getattr(forkserver._forkserver, "_preload_modules", [])
    multiprocessing.set_forkserver_preload(sorted((set(current) - {"__main__"}) | set(modules)))


_preload_in_fork_server("torch", "ckpt_engine_worker")
