"""Backend registry: in-tree backends by dotted path, third-party ones by entry point."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from ._base import CheckpointEngine

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendCapabilities",
    "CheckpointEngineRegistry",
    "backend_for_device",
    "registry",
]

ENTRY_POINT_GROUP = "rlwire.ckpt_engine.backends"

# name -> (module:attribute, module its optional dependency lives in ("cuda": a CUDA
# device), how to get it)
_IN_TREE: dict[str, tuple[str, str | None, str | None]] = {
    "gloo": ("rlwire.ckpt_engine.backends._gloo:GlooEngine", None, None),
    "shm": ("rlwire.ckpt_engine.backends._shm:ShmEngine", None, None),
    "naive": ("rlwire.ckpt_engine.backends._naive:NaiveEngine", None, None),
    "filesystem": (
        "rlwire.ckpt_engine.backends._filesystem:FilesystemEngine",
        "safetensors,numpy",
        "pip install 'rlwire-ckpt-engine[filesystem]'",
    ),
    "nccl": ("rlwire.ckpt_engine.backends._broadcast:NcclEngine", "cuda", "needs a CUDA device"),
    "cuda_ipc": (
        "rlwire.ckpt_engine.backends._cuda_ipc:CudaIpcEngine",
        "cuda",
        "needs a CUDA device",
    ),
    "hccl": (
        "rlwire.ckpt_engine.backends._broadcast:HcclEngine",
        "torch_npu",
        "install torch_npu (Ascend's PyTorch adapter) matching your torch",
    ),
}

_DEVICE_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def backend_for_device(device_type: str) -> str:
    """The default backend for a device type: ``cuda``→``nccl``, ``npu``→``hccl``, ``cpu``→``gloo``.

    Raises:
        ValueError: unknown device type; lists the known ones.
    """
    try:
        return _DEVICE_BACKENDS[device_type]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_DEVICE_BACKENDS))
        raise ValueError(
            f"device_type: {device_type!r} has no default backend; known: {known}"
        ) from None


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a backend offers, known without building it (see :class:`CheckpointEngine`)."""

    device_type: str
    """Where its buckets live: ``cpu``, ``cuda`` or ``npu``."""
    uses_store: bool
    """Receivers connect to a TCP store on the master (give the master a reachable ``host``)."""
    zero_copy: bool
    """It offers ``share_weights`` (the sender's tensors in shared memory, read in place)."""
    delta: bool = False
    """It sends lossless delta updates (``delta="on"`` or ``"auto"``)."""


_P = ParamSpec("_P")
_R = TypeVar("_R")


class _ClassOrInstance(Generic[_P, _R]):
    """A method that also works on the class, where it acts on the default registry.

    Code written against verl calls ``CheckpointEngineRegistry.new(name, **kw)`` (its
    registry is class-level); ours calls ``registry.new(...)``. Both reach one object.
    """

    def __init__(self, method: Callable[Concatenate[CheckpointEngineRegistry, _P], _R]) -> None:
        self._method = method
        # The descriptor takes the method's name and docstring (for help() and the docs).
        functools.update_wrapper(self, method)  # type: ignore[arg-type]  # typeshed: callables

    def __get__(self, instance: CheckpointEngineRegistry | None, owner: type) -> Callable[_P, _R]:
        return functools.partial(self._method, instance if instance is not None else registry)


class CheckpointEngineRegistry:
    """Maps backend names to :class:`CheckpointEngine` classes.

    In-tree backends are registered by dotted path and imported on first use;
    third-party ones come from the entry-point group ``rlwire.ckpt_engine.backends``
    (``name = "package.module:Class"``), discovered lazily.

    Every method works on an instance and on the class itself, where it acts on the
    process-wide default :data:`registry` (as verl's class-level registry does):
    ``CheckpointEngineRegistry.new("shm", ...)`` is ``registry.new("shm", ...)``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._classes: dict[str, type[CheckpointEngine]] = {}
        self._lazy: dict[str, tuple[str, str | None, str | None]] = dict(_IN_TREE)
        self._entry_points_loaded = False

    @_ClassOrInstance
    def register(self, name: str) -> Callable[[type[CheckpointEngine]], type[CheckpointEngine]]:
        """Class decorator registering a backend under ``name``.

        Raises:
            ValueError: ``name`` is already registered (in-tree names included).
        """

        def decorate(cls: type[CheckpointEngine]) -> type[CheckpointEngine]:
            with self._lock:
                if name in self._classes or name in self._lazy:
                    raise ValueError(f"checkpoint engine {name!r} is already registered")
                if not (isinstance(cls, type) and issubclass(cls, CheckpointEngine)):
                    raise TypeError(f"{cls!r} is not a CheckpointEngine subclass")
                self._classes[name] = cls
            return cls

        return decorate

    def _load_entry_points(self) -> None:
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name not in self._classes and ep.name not in self._lazy:
                    self._lazy[ep.name] = (ep.value, None, None)

    def _missing_dependency(self, name: str) -> str | None:
        _, module, hint = self._lazy.get(name, (None, None, None))
        if module == "cuda":
            import torch

            return None if torch.cuda.is_available() else hint
        if module is not None and any(
            importlib.util.find_spec(m) is None for m in module.split(",")
        ):
            return hint
        return None

    @_ClassOrInstance
    def available(self) -> list[str]:
        """Every registered backend name, buildable here or not (see :meth:`status`)."""
        self._load_entry_points()
        return sorted(set(self._classes) | set(self._lazy))

    @_ClassOrInstance
    def status(self) -> dict[str, str | None]:
        """Per registered name: ``None`` if it can be built here, else why not and what to do."""
        self._load_entry_points()
        return {name: self._missing_dependency(name) for name in self.available()}

    @_ClassOrInstance
    def usable(self) -> list[str]:
        """The registered names that can be built here (their optional dependencies present)."""
        return [name for name, why in self.status().items() if why is None]

    @_ClassOrInstance
    def get(self, name: str) -> type[CheckpointEngine]:
        """The class registered as ``name`` (importing it on first use).

        Raises:
            ValueError: unknown name; lists what is available and what needs an extra.
            ImportError: the backend's optional dependency is missing (says what to install).
        """
        self._load_entry_points()
        if name in self._classes:
            return self._classes[name]
        if name not in self._lazy:
            missing = {n: self._missing_dependency(n) for n in self._lazy}
            hints = "; ".join(f"{n} ({h})" for n, h in sorted(missing.items()) if h)
            message = f"unknown checkpoint engine {name!r}; available: {', '.join(self.usable())}"
            if hints:
                message += f"; unavailable here: {hints}"
            raise ValueError(message)
        hint = self._missing_dependency(name)
        if hint:
            raise ImportError(f"checkpoint engine {name!r} is unavailable here: {hint}")
        target, _, _ = self._lazy[name]
        module_name, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
        if not (isinstance(cls, type) and issubclass(cls, CheckpointEngine)):
            raise TypeError(f"checkpoint engine {name!r} ({target}) is not a CheckpointEngine")
        with self._lock:
            self._classes[name] = cls
            self._lazy.pop(name, None)
        return cls

    @_ClassOrInstance
    def capabilities(self, name: str) -> BackendCapabilities:
        """What backend ``name`` offers, also where it cannot be built (no CUDA here, say).

        Raises:
            ValueError: unknown name (as :meth:`get`).
            ImportError: its module needs a package that is missing.
        """
        self._load_entry_points()
        if name not in self._classes and name not in self._lazy:
            self.get(name)  # raises the unknown-name error, listing what exists
        if name in self._classes:
            cls = self._classes[name]
        else:  # not imported yet: its module, without the dependency check of get()
            module_name, _, attr = self._lazy[name][0].partition(":")
            cls = getattr(importlib.import_module(module_name), attr)
        return BackendCapabilities(
            device_type=cls.device_type,
            uses_store=cls.uses_store,
            zero_copy=cls.zero_copy,
            delta=cls.supports_delta,
        )

    @_ClassOrInstance
    def new(self, /, name: str, **kwargs: Any) -> CheckpointEngine:
        """Construct backend ``name`` with ``kwargs`` (common options plus backend ones)."""
        return self.get(name)(**kwargs)


registry = CheckpointEngineRegistry()
"""The process-wide registry (``rlwire.ckpt_engine.registry``)."""
