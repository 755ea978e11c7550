"""Engines by name or by dotted path: the one lookup behind every engine seam."""

from __future__ import annotations

import importlib

__all__ = ["load_class"]


def load_class(key: str, value: str, known: dict[str, str], base: type) -> type:
    """The class ``value`` names for config key ``key``.

    Args:
        key: the config key, for messages (``actor.strategy``).
        value: a name from ``known`` or a dotted path ``package.module:Class``.
        known: name -> ``module:Class`` of the in-tree engines (imported on first use).
        base: the class every engine subclasses.

    Raises:
        ValueError: unknown name, malformed path, or not a ``base`` subclass.
        ImportError: the module cannot be imported (its own message).
    """
    target = known.get(value, value)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        names = ", ".join(repr(n) for n in known)
        raise ValueError(
            f"{key}: {value!r} is not allowed; use {names} or a dotted path "
            f"'package.module:Class' to a {base.__name__} subclass"
        )
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{key}: {target} is not a {base.__name__} subclass")
    return cls
