"""Reading a data source's rows: a JSONL or Parquet file, or a Hub dataset (a local snapshot
read with ``datasets``), each row as ``(where, row)`` (``where`` names it in errors)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import RunError

__all__ = ["hub_rows", "is_hub_id", "read_file", "read_rows"]


def read_rows(
    source: Path | str, key: str, subset: str | None, split: str
) -> list[tuple[str, Any]]:
    """The rows of a data file (a ``Path``) or of split ``split`` of a Hub dataset (its id)."""
    if isinstance(source, Path):
        return read_file(source, key)
    return hub_rows(source, subset, split, key)


def read_file(path: Path, key: str) -> list[tuple[str, Any]]:
    """``(where, row)`` for every row of the file (``where`` names it in errors)."""
    if path.suffix == ".jsonl":
        rows = []
        try:
            lines = path.read_bytes().splitlines()
        except OSError as err:  # unreadable: permissions, a vanished file
            raise RunError(f"{key}: cannot read {path}: {err.strerror}") from None
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise RunError(
                    f"{key}: {path} line {number} is not UTF-8 text (byte {err.start + 1}: "
                    f"{raw[err.start : err.start + 1]!r}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise RunError(f"{key}: {path} line {number} is not JSON: {err}") from None
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise RunError(
                f"{key}: reading Parquet needs pyarrow: pip install 'rlwire-trainer[parquet]'"
            ) from None
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as err:  # unreadable, or not Parquet (ArrowInvalid)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RunError(f"{key}: cannot read {path} as Parquet: {first}") from None
        return [(f"row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]
    raise RunError(f"{key}: {path} must be .jsonl or .parquet")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` looks like a Hub id (``org/name``) rather than a local path."""
    return bool(_HUB_ID.match(text)) and not Path(text).exists()


def hub_rows(repo_id: str, subset: str | None, split: str, key: str) -> list[tuple[str, Any]]:
    """Every row of split ``split`` of the Hub dataset ``repo_id`` (a local snapshot first:
    :func:`rlwire.trainer.models.hub.snapshot`)."""
    from ..models.hub import snapshot

    folder = snapshot(repo_id, key, repo_type="dataset")
    try:
        import datasets
    except ImportError:
        raise RunError(
            f"{key}: reading the Hub dataset {repo_id!r} needs datasets: pip install "
            "'rlwire-trainer[datasets]'"
        ) from None
    try:
        table = datasets.load_dataset(str(folder), name=subset, split=split)
    except (ValueError, FileNotFoundError) as err:  # no such subset or split
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunError(
            f"{key}: cannot read split {split!r} of {repo_id!r} (subset {subset!r}): {first}"
        ) from None
    return [(f"row {i}", row) for i, row in enumerate(table, 1)]
