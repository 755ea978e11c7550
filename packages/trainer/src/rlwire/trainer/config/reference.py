"""The configuration reference: every section and key with its type, default and the
docstring written under its field, as Markdown (``--help-config`` and the docs site)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from .overrides import field_key, plain
from .root import TrainerConfig

__all__ = ["describe_config"]


def _field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field of ``cls`` (read from its source)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    definition = tree.body[0]
    assert isinstance(definition, ast.ClassDef)  # the source of a class
    body = definition.body
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def describe_config() -> str:
    """A Markdown reference of every section and key: type, default and documentation."""
    lines: list[str] = []
    root = TrainerConfig()

    def section(obj: Any, prefix: str) -> None:
        cls = type(obj)
        hints = typing.get_type_hints(cls)
        docs = _field_docs(cls)
        rows, nested = [], []
        for f in dataclasses.fields(cls):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((value, f"{prefix}{field_key(f.name)}."))
                continue
            kind = getattr(hints[f.name], "__name__", str(hints[f.name])).replace("|", "or")
            key, doc = f"{prefix}{field_key(f.name)}", docs.get(f.name, "")
            rows.append(f"| `{key}` | {kind} | `{plain(value)!r}` | {doc} |")
        if rows:
            lines.append(f"\n### `{prefix.rstrip('.')}`\n")
            lines.append("| key | type | default | meaning |\n|---|---|---|---|")
            lines.extend(rows)
        for child, child_prefix in nested:
            section(child, child_prefix)

    section(root, "")
    return "\n".join(lines).strip() + "\n"
