"""In-process hooks of the fault campaign (:mod:`rlwire.trainer.tools.faults`), installed in every
process of a run as its ``sitecustomize``: the campaign copies this file under that name
into a folder it puts first on ``PYTHONPATH`` (Ray's workers inherit the driver's
environment, so the hooks reach the actor ranks and the rollout workers too; the campaign
checks that their events arrive). Standard library only: it runs at interpreter start-up.
Imported under its own name it does nothing.

What it does, steered by environment variables:

- ``RLWIRE_FAULT_EVENTS=PATH``: the phase methods of ``ActorWorker`` (``train``: update,
  ``save``: save, ``push_weights``/``start_push``: push), ``RolloutWorker``
  (``generate``: generation, ``pull_weights``/``stage_weights``: push) and the fully-async
  loop's ``ServeLoop._generate`` (generation: a chunk of groups) append a line to
  PATH at their start and end: time, pid, role (``actor<rank>``, ``rollout<index>``),
  phase, the occurrence's number in that process, ``b`` or ``e``. Each ``__init__`` appends
  an ``init`` line (the process's role and pid).
- ``RLWIRE_FAULT_STRETCH=ROLE:PHASE:N:SECONDS``: occurrence ``N`` of PHASE in ROLE is
  slowed to about SECONDS: occurrence ``N - 1`` counts its Python line events
  (``sys.settrace``), occurrence ``N`` sleeps ``SECONDS / count`` at each one. A kill at a
  uniformly random time inside it then lands at a random line of the phase's real code
  (time spent inside one C call, a torch kernel or torch's own file writer, is not
  stretched, so points inside those are under-sampled).
- ``RLWIRE_FAULT_PAUSE=step_N``: the driver's ``finish_checkpoint`` of ``step_N`` (called
  once every actor rank's part and ``trainer_state.json`` are written, before the manifest
  and ``COMPLETE``) logs a ``pause`` line and sleeps :data:`PAUSE_S` s first: the campaign
  kills the driver there (the ``uncommitted`` trial).
- ``RLWIRE_FAULT_STOP=step_N``: once the driver's ``finish_checkpoint`` of ``step_N`` has
  returned (``COMPLETE`` written), it logs a ``stop`` line and SIGTERMs itself: the run
  stops there as a scheduler's stop does (one line, Ray stopped, nothing pruned after
  it), for the model check's reference resumed at that step
  (:mod:`rlwire.trainer.tools.fault_model`).
- ``RLWIRE_FAULT_ENOSPC=FRAGMENT``: a file opened for writing through ``open`` /
  ``io.open`` (``pathlib`` too) whose path contains FRAGMENT is created, and its first
  ``write`` raises ``OSError(ENOSPC)``, as a full disk does; an ``enospc`` line is logged.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType, ModuleType
from typing import Any

PHASES = {
    "rlwire.trainer.runtime.workers": (
        "ActorWorker",
        {"train": "update", "save": "save", "push_weights": "push", "start_push": "push"},
    ),
    "rlwire.trainer.runtime.rollout_worker": (
        "RolloutWorker",
        {"generate": "generation", "pull_weights": "push", "stage_weights": "push"},
    ),
    # fully async generates in the worker's loop: a coroutine per chunk of groups
    "rlwire.trainer.runtime.rollout_serve": ("ServeLoop", {"_generate": "generation"}),
}
"""Module -> (class, {method: phase}) wrapped at import (a coroutine method by a coroutine;
the role is the object's, or its ``worker``'s)."""
PAUSES = {"rlwire.trainer.outputs.checkpoint": "finish_checkpoint"}
"""Module -> the function ``RLWIRE_FAULT_PAUSE`` pauses and after which ``RLWIRE_FAULT_STOP``
stops (its first argument: the directory)."""
PAUSE_S = 300.0
"""How long the pause lasts: the campaign kills the driver long before (a pause that ends
lets the save complete, which the trial's checks name)."""

_counts: dict[tuple[str, str], int] = {}
_lines: dict[tuple[str, str, int], int] = {}
_lock = threading.Lock()


def emit(**fields: Any) -> None:
    """One event line (a single ``write`` on an ``O_APPEND`` file: lines never interleave)."""
    path = os.environ.get("RLWIRE_FAULT_EVENTS")
    if not path:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _role(obj: object) -> str:
    rank = getattr(obj, "rank", None)
    return f"rollout{getattr(obj, 'index', '?')}" if rank is None else f"actor{rank}"


def _stretch_plan(role: str, phase: str, n: int) -> tuple[bool, float | None]:
    """(count this occurrence's lines, seconds to stretch it to) from RLWIRE_FAULT_STRETCH."""
    spec = os.environ.get("RLWIRE_FAULT_STRETCH", "")
    if spec.count(":") != 3:
        return False, None
    who, what, number, seconds = spec.split(":")
    if (who, what) != (role, phase):
        return False, None
    target = int(number)
    return n == target - 1, float(seconds) if n == target else None


class _Tracer:
    """Counts line events of the frames called while it is set; sleeps ``pause`` at each."""

    def __init__(self, pause: float) -> None:
        self.pause, self.lines, self.owed = pause, 0, 0.0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> _Tracer:
        if event == "line":
            self.lines += 1
            self.owed += self.pause
            if self.owed >= 0.002:  # a sleep takes ~0.1 ms at least: pay the pauses in bulk
                start = time.perf_counter()
                time.sleep(self.owed)
                self.owed -= time.perf_counter() - start
        return self


@contextlib.contextmanager
def _occurrence(owner: object, phase: str) -> Iterator[None]:
    """One occurrence of ``phase`` in ``owner``'s role: its begin and end lines, its Python
    lines counted or stretched as ``RLWIRE_FAULT_STRETCH`` says (in a coroutine, the
    event loop's other tasks are slowed with it: the process's generation is)."""
    role = _role(getattr(owner, "worker", owner))
    with _lock:
        n = _counts[role, phase] = _counts.get((role, phase), 0) + 1
    count, seconds = _stretch_plan(role, phase, n)
    tracer = None
    if count or seconds is not None:
        lines = _lines.get((role, phase, n - 1), 0)
        tracer = _Tracer(seconds / lines if seconds and lines else 0.0)
    emit(role=role, phase=phase, n=n, ev="b", stretched=seconds)
    previous = sys.gettrace()
    if tracer is not None:
        sys.settrace(tracer)
    try:
        yield
    finally:
        if tracer is not None:
            sys.settrace(previous)
            _lines[role, phase, n] = tracer.lines
        emit(role=role, phase=phase, n=n, ev="e", lines=tracer and tracer.lines)


def _wrap(method: Callable[..., Any], phase: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def wait(self: object, *args: Any, **kwargs: Any) -> Any:
            with _occurrence(self, phase):
                return await method(self, *args, **kwargs)

        return wait

    @functools.wraps(method)
    def call(self: object, *args: Any, **kwargs: Any) -> Any:
        with _occurrence(self, phase):
            return method(self, *args, **kwargs)

    return call


def _wrap_init(method: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(method)
    def init(self: object, *args: Any, **kwargs: Any) -> None:
        method(self, *args, **kwargs)
        emit(role=_role(self), ev="init")

    return init


def _step_dir(directory: Any) -> str:
    """``step_N`` of a save's directory (written as ``step_N.partial``, then renamed)."""
    return os.path.basename(os.fspath(directory)).removesuffix(".partial")


def _pausing(function: Callable[..., Any], step_dir: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(directory: Any, *args: Any, **kwargs: Any) -> Any:
        if _step_dir(directory) == step_dir:
            emit(role="driver", ev="pause", path=os.fspath(directory))
            time.sleep(PAUSE_S)
        return function(directory, *args, **kwargs)

    return call


def _stopping(function: Callable[..., Any], step_dir: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(directory: Any, *args: Any, **kwargs: Any) -> Any:
        result = function(directory, *args, **kwargs)
        if _step_dir(directory) == step_dir:
            emit(role="driver", ev="stop", path=os.fspath(directory))
            # the driver's handler raises its stop in the main thread at the next bytecode
            # (the sleep is interrupted): nothing after this save runs, its pruning included
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(PAUSE_S)
        return result

    return call


def _patch(module: ModuleType) -> None:
    if module.__name__ in PAUSES:
        name = PAUSES[module.__name__]
        function = getattr(module, name)
        if os.environ.get("RLWIRE_FAULT_PAUSE"):
            function = _pausing(function, os.environ["RLWIRE_FAULT_PAUSE"])
        if os.environ.get("RLWIRE_FAULT_STOP"):
            function = _stopping(function, os.environ["RLWIRE_FAULT_STOP"])
        setattr(module, name, function)
        return
    cls_name, methods = PHASES[module.__name__]
    cls: Any = getattr(module, cls_name)
    for name, phase in methods.items():
        _set(cls, name, _wrap(getattr(cls, name), phase))
    if module.__name__ != "rlwire.trainer.runtime.rollout_serve":  # (its worker's role)
        _set(cls, "__init__", _wrap_init(cls.__init__))


def _set(cls: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """``cls.name = wrapper``, named as the class's own method: Ray pickles the worker class
    by reference, which holds only while ``module.qualname`` finds this very function (a
    method inherited from a mixin would otherwise name the mixin's unwrapped one, and the
    wrapper would be pickled by value, its lock with it)."""
    wrapper.__module__, wrapper.__qualname__ = cls.__module__, f"{cls.__qualname__}.{name}"
    setattr(cls, name, wrapper)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the worker modules right after they execute, wherever they are imported."""

    def find_spec(
        self, name: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        pause = name in PAUSES and any(
            os.environ.get(f"RLWIRE_FAULT_{what}") for what in ("PAUSE", "STOP")
        )
        if name not in PHASES and not pause:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this one only
        return spec


class _Full:
    """A file on a full disk: created, and every write fails with ENOSPC; everything else
    (``tell``, ``flush``, ``fileno``, closing) is the real file's."""

    def __init__(self, real: Any, path: str) -> None:
        self.real, self.path = real, path

    def write(self, data: Any) -> int:
        emit(ev="enospc", path=self.path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def __enter__(self) -> _Full:
        return self

    def __exit__(self, *exc: object) -> None:
        self.real.close()


def _full_disk(fragment: str) -> None:
    real_open = io.open

    def guarded(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            path = os.fsdecode(file)
            if fragment in path:
                return _Full(handle, path)
        return handle

    builtins.open = io.open = guarded


def install() -> None:
    if os.environ.get("RLWIRE_FAULT_EVENTS"):
        sys.meta_path.insert(0, _Finder())
    fragment = os.environ.get("RLWIRE_FAULT_ENOSPC")
    if fragment:
        _full_disk(fragment)


if __name__ == "sitecustomize":
    install()
