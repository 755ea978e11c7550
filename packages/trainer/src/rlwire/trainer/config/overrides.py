"""Reading configuration text into typed section dataclasses: YAML scalars, dotted keys
nested into sections and merged field by field (an unknown key names the valid ones and the
closest match; a wrong type names the key), and back to plain dicts.

Generic over any tree of dataclasses; imports the foundation only."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any

from ..checks import ConfigError

__all__ = [
    "field_key",
    "joined",
    "flatten",
    "merge",
    "nest",
    "parse_item",
    "parse_scalar",
    "plain",
    "to_dict",
]


def field_key(field_name: str) -> str:
    """A field's key in files and overrides: ``async_`` (a Python keyword) is ``async``."""
    return field_name.rstrip("_")


def plain(value: Any) -> Any:
    """A value as YAML and JSON write it: enums (a library's policy) by their value."""
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    return value.value if isinstance(value, enum.Enum) else value


def to_dict(config: Any) -> dict:
    """A nested plain dict of a config (for YAML, JSON and ``--print-config``)."""
    return {field_key(f.name): plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def parse_scalar(text: str) -> Any:
    """YAML's reading of an override value; numbers YAML 1.1 leaves as strings (``3e-4``) too."""
    import yaml

    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:  # not YAML ("...", "a: b: c"): the text as it is
        value = text
    if isinstance(value, str):
        number = _number(value)
        return value if number is None else number
    return value


def _number(text: str) -> int | float | None:
    """``text`` as an int or a float, or None when it is neither."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return None


def _coerce(key: str, annotation: Any, value: Any) -> Any:
    hint = annotation
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        hint = options[0]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _number(value) is not None:
            return float(value)  # YAML 1.1 reads "3e-4" in a file as a string
    elif hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare on/off (yes/no) as a boolean
            return "on" if value else "off"
        if isinstance(value, (str, int, float)):
            return str(value)
    elif typing.get_origin(hint) is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    else:
        return value
    raise ConfigError(f"{key}: {value!r} is not a {hint.__name__}")


def merge(
    cls: type, base: Any, updates: Mapping[str, Any], prefix: str, problems: list | None = None
) -> Any:
    """``base`` (a ``cls``) with ``updates`` merged in, checked. Every problem of the tree is
    gathered and raised in one :class:`ConfigError`, a line each (an unknown key, a wrong
    type, a section's own check), so that one pass shows them all; the top level's own
    cross-checks run once its sections are sound."""
    top = problems is None
    found: list[str] = [] if problems is None else problems
    before, own = len(found), 0  # own: this section's fields' problems (not its sections')
    fields = {field_key(f.name): f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {name: getattr(base, name) for name in fields.values()}
    for key, value in updates.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            found.append(
                f"{full}: unknown key; valid keys under {prefix.rstrip('.') or 'the top level'}: "
                f"{', '.join(sorted(fields))}{hint}"
            )
            own += 1
            continue
        name = fields[key]
        hint_type = hints[name]
        if isinstance(hint_type, type) and dataclasses.is_dataclass(hint_type):
            if not isinstance(value, Mapping):
                found.append(f"{full}: expected a section (mapping), got {value!r}")
                own += 1
                continue
            values[name] = merge(hint_type, values[name], value, f"{full}.", found)
        else:
            try:
                values[name] = _coerce(full, hint_type, value)
            except ConfigError as err:
                found.append(str(err))
                own += 1
    if top and found:
        raise ConfigError(joined(found))
    # A section's checks over half-merged fields would mislead (the root's cross-checks over
    # any half-merged section too); over a sound section beside a bad one they still run.
    if own or (not prefix and len(found) > before):
        return base
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            message = str(err)
        else:  # a library's config names its own fields ("GradSyncConfig.policy: ..."): ours
            message = str(err).replace(f"{cls.__name__}.", prefix)
            if message == str(err):
                message = f"{prefix.rstrip('.') or 'config'}: {err}"
        if top:
            raise ConfigError(message) from None
        found.append(message)
        return base


def joined(problems: list[str]) -> str:
    """Problems as one error: the problem itself, or a count and a line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the configuration:\n  " + "\n  ".join(problems)


def nest(dotted: Mapping[str, Any]) -> dict:
    tree: dict = {}
    for key, value in dotted.items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: conflicts with a value set for {part}")
        node[parts[-1]] = value
    return tree


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resolve_interpolations(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (dotted keys, verl's names or ours, from the file and the command line) with
    every ``${...}`` interpolation resolved by OmegaConf, as verl's Hydra loading resolves
    it (``${data.max_response_length}``, ``${oc.env:HOME}``); unchanged without one.
    Raises ConfigError naming the key whose interpolation fails."""
    if not any(isinstance(v, str) and "${" in v for v in _leaves(flat)):
        return flat
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    tree = OmegaConf.create(nest(flat))
    resolved: dict[str, Any] = {}
    for key, value in flat.items():
        if not any(isinstance(v, str) and "${" in v for v in _leaves({key: value})):
            resolved[key] = value
            continue
        try:
            node = OmegaConf.select(tree, key, throw_on_missing=True)
            is_node = OmegaConf.is_config(node)
            resolved[key] = OmegaConf.to_container(node, resolve=True) if is_node else node
        except OmegaConfBaseException as err:
            first = str(err).strip().splitlines()[0]
            raise ConfigError(f"{key}: cannot resolve {value!r}: {first}") from None
    return resolved


def _leaves(flat: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for value in flat.values():
        if isinstance(value, list):
            out.extend(value)
        elif isinstance(value, Mapping):
            out.extend(_leaves(value))
        else:
            out.append(value)
    return out


def parse_item(text: str) -> tuple[str, Any]:
    """``dotted.key=value`` (a preset's or a task's own override) as its key and value."""
    key, _, value = text.partition("=")
    return key, parse_scalar(value)
