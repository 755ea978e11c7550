"""What every configuration section validates with: the one error (``ConfigError`` names the
key, the value and what is allowed) and the checks that raise it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ConfigError", "check", "check_choice", "check_engine"]


class ConfigError(ValueError):
    """A configuration value or key is not allowed; the message names the key."""


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {value!r} is not allowed; {allowed}")


def check_choice(value: Any, key: str, choices: tuple[str, ...]) -> None:
    """``value`` must be one of ``choices`` (the message lists them: "use 'a', 'b' or 'c'")."""
    quoted = [repr(c) for c in choices]
    listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    check(value in choices, key, value, f"use {listed}")


def check_engine(value: str, key: str, known: dict, load: Callable[[str], type]) -> None:
    """An engine name from ``known``, or a dotted path imported now so a bad one fails early."""
    if ":" not in value:
        check_choice(value, key, tuple(known))
        return
    try:
        load(value)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"{key}: cannot load {value!r}: {err}") from None
