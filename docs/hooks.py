"""MkDocs hooks: the tables that are generated from the code when the site is built.

A line holding only a marker below is replaced by the Markdown its function returns, so
the site cannot drift from the code: the configuration reference from the trainer's
dataclasses, verl's key table from the alias list, Megatron's bytes per parameter from the
memory model. (megatron_ddp's README keeps a copy of its table, which a test compares with
the same function; the other two are on the site only.) A marker that no page uses fails the
build, as does a function that raises.

The hook imports the rlwire packages, so the site is built in the workspace environment:
``uv run --with mkdocs-material==9.8.2 ... mkdocs build --strict`` (see ``.ci/run``).
"""

from __future__ import annotations

import importlib
from typing import Any

from mkdocs.exceptions import PluginError

GENERATED: dict[str, tuple[str, str]] = {
    "<!-- config-reference -->": ("rlwire.trainer.config", "describe_config"),
    "<!-- verl-keys -->": ("rlwire.trainer.config.verl_keys", "alias_table"),
    "<!-- megatron-ddp-memory-table -->": ("rlwire.megatron_ddp._table", "memory_table"),
}
"""Marker line -> (module, function returning Markdown)."""

_used: set[str] = set()


def _generate(marker: str) -> str:
    module, function = GENERATED[marker]
    try:
        text = getattr(importlib.import_module(module), function)()
    except Exception as err:  # the build must say which table failed, not only why
        raise PluginError(f"{marker}: {module}.{function}() failed: {err!r}") from err
    return text.strip("\n")


def on_pre_build(config: Any) -> None:
    _used.clear()  # `mkdocs serve` rebuilds in one process


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        marker = line.strip()
        if marker in GENERATED:
            lines[i] = _generate(marker)
            _used.add(marker)
    return "\n".join(lines)


def on_post_build(config: Any) -> None:
    unused = sorted(set(GENERATED) - _used)
    if unused:
        raise PluginError(f"generated tables no page shows (marker line missing): {unused}")
