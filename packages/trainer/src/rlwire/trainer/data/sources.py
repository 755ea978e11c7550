"""Where a run's rows come from, worked out once: :func:`resolve_source` turns ``data.source``
(or ``validation.source``, or rows the Python API hands over) into one :class:`Source` that
every later step reads (the rows, the reward's built-in task) without looking again."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import RunError
from .readers import is_hub_id, read_rows
from .tasks import BUILTIN_TASKS, Task, builtin_task

__all__ = ["Source", "resolve_source"]


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    """One source of rows, exactly one of ``task``, ``path``, ``hub_id``, ``rows`` and
    ``parts`` set. ``key`` is the setting it came from (``data.source``: named in every
    error), ``spec`` what was given there (a label when ``rows`` are given)."""

    key: str
    spec: str
    task: Task | None = None
    """A built-in task (``builtin:<name>``): its examples are generated, never read."""
    path: Path | None = None
    """A JSONL or Parquet file."""
    hub_id: str | None = None
    """A Hub dataset (``org/name``)."""
    rows: tuple[Mapping[str, Any], ...] | None = None
    """The rows themselves (the Python API's ``train_dataset``/``eval_dataset``)."""
    parts: tuple[Source, ...] = ()
    """Several files or Hub datasets read as one data set, in this order."""

    @property
    def label(self) -> str:
        """What errors call the rows' origin: the file, the Hub id, or the API argument."""
        if self.rows is not None:
            return "train_dataset" if self.key == "data.source" else "eval_dataset"
        return str(self.path) if self.path is not None else self.spec

    def read(self, subset: str | None, split: str) -> list[tuple[str, Any]]:
        """Every row, ``(where, row)`` (``where``: "line 3", "row 3"), of a file, a Hub
        dataset or the given rows (``subset`` and ``split``: a Hub dataset's)."""
        assert self.task is None, f"{self.key}: a built-in task's examples are generated"
        assert not self.parts, f"{self.key}: several sources are read one by one"
        if self.rows is not None:
            return [(f"row {i}", row) for i, row in enumerate(self.rows, 1)]
        found: Path | str = self.path if self.path is not None else str(self.hub_id)
        return read_rows(found, self.key, subset, split)


def resolve_source(
    spec: str | Sequence[str], key: str, rows: Sequence[Mapping[str, Any]] | None = None
) -> Source:
    """The source ``spec`` names (``builtin:<name>``, a file, or a Hub dataset id; a list
    of files and Hub ids: one data set), or ``rows`` given in its place (``spec`` is then
    only a label). Raises RunError naming ``key`` for anything else."""
    if rows is not None:
        return Source(key, spec if isinstance(spec, str) else ", ".join(spec), rows=tuple(rows))
    if not isinstance(spec, str):
        if len(spec) == 1:
            return resolve_source(spec[0], key)
        parts = tuple(resolve_source(one, key) for one in spec)
        if any(part.task is not None for part in parts):
            raise RunError(f"{key}: a built-in task cannot be read beside files: {list(spec)}")
        return Source(key, ", ".join(spec), parts=parts)
    task = builtin_task(spec)
    if task is not None:
        return Source(key, spec, task=task)
    path = Path(spec).expanduser()
    if path.is_file():
        return Source(key, spec, path=path)
    if is_hub_id(spec):
        return Source(key, spec, hub_id=spec)
    names = " or ".join(repr(f"builtin:{name}") for name in BUILTIN_TASKS)
    raise RunError(f"{key}: {spec!r} is neither {names}, a file, nor a Hub dataset id (org/name)")
