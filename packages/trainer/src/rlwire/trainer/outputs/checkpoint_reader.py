"""Reading a DCP checkpoint without running code from it (and DCP's failures in one line).

torch.distributed.checkpoint writes ``actor/.metadata`` with ``pickle`` and reads it with
``pickle.load``, and its default planner reads the non-tensor values of the state (the
optimizer's parameter groups) with ``torch.load(weights_only=False)``: a checkpoint from
elsewhere could run anything on resume. :class:`SafeReader` reads the metadata with an
unpickler that builds only what DCP puts there (its metadata dataclasses, ``torch.Size``,
dtypes, layouts, paths) and refuses an entry whose file lies outside the checkpoint's
directory; :class:`SafeLoadPlanner` reads those values once, as tensors and plain data only.
Anything else is refused, naming the file.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ..errors import RunError

__all__ = ["SafeLoadPlanner", "SafeReader", "failure", "load", "read_state", "refusal", "save"]

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    **{
        (dcp_metadata.__name__, name): value
        for name, value in vars(dcp_metadata).items()
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__
    },
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RunError(
            f"{self.path}: names {module}.{name}, which DCP's metadata never holds; refused "
            "(a checkpoint must not run code when it is loaded)"
        )


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by :class:`_MetadataUnpickler`, and
    only files inside the checkpoint's directory read."""

    refused: RunError | None = None
    """This reader's refusal of a metadata file. DCP turns an exception of ``read_metadata``
    into an ``AssertionError`` quoting it (it falls back to a rank's own metadata file), so
    :func:`load` raises this one instead."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        try:
            return self._read_metadata(self._get_metadata_path(kwargs.get("rank")))
        except RunError as err:
            self.refused = self.refused or err
            raise

    def _read_metadata(self, path: os.PathLike) -> dcp_metadata.Metadata:
        with self.fs.create_stream(path, "rb") as file:
            try:
                metadata = _MetadataUnpickler(file, str(path)).load()
            except (pickle.UnpicklingError, EOFError, ValueError) as err:
                raise RunError(f"{path}: not a DCP metadata file ({err})") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise RunError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            metadata.storage_meta = storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._confine(metadata)

    def _confine(self, metadata: dcp_metadata.Metadata) -> None:
        """Refuse an entry whose file is not inside the checkpoint's directory: DCP opens
        ``directory / relative_path`` as it is, so ``../x``, an absolute path or a symlink
        would read any file the process can (every rank sets up its reader: each checks)."""
        root, inside = Path(self.path).resolve(), set()
        for index, info in (metadata.storage_data or {}).items():
            if info.relative_path in inside:  # many entries share one file: resolved once
                continue
            target = (root / info.relative_path).resolve()
            if not target.is_relative_to(root):
                raise RunError(
                    f"{self.path}: entry {index.fqn!r} of its .metadata reads {target}, outside "
                    "the checkpoint's directory; refused (a checkpoint reads its own files only)"
                )
            inside.add(info.relative_path)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values read as tensors and plain data."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        """Read one non-tensor entry once, with ``weights_only=True``, and put it where
        ``DefaultLoadPlanner.load_bytes`` does (the same in torch 2.11 to 2.15): along the
        flattening's mapping into the caller's nested state, or under its key when nothing
        was flattened. (Checking with ``weights_only`` and then calling it read each entry
        twice, the second time with ``weights_only=False``.)"""
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise RunError(f"checkpoint entry {fqn!r}: {refusal(err)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def refusal(err: pickle.UnpicklingError) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line."""
    lines = [line.strip() for line in str(err).splitlines()]
    reason = next((line for line in lines if "Unsupported" in line), lines[0] if lines else "")
    reason = reason.removeprefix("WeightsUnpickler error: ")
    if "Unsupported global" not in reason:
        return f"cannot be read ({reason}); is the file damaged?"
    return (
        "holds objects other than tensors and plain data; refused (a checkpoint must not run "
        f"code when it is loaded): {reason}"
    )


def load(state: dict[str, Any], directory: Path) -> None:
    """``dcp.load`` of ``directory`` into ``state`` with the safe reader and planner; a
    failure on any rank is one :class:`RunError` naming the checkpoint (DCP gathers them
    into a ``CheckpointException``, a ``BaseException`` with every rank's traceback)."""
    reader = SafeReader(directory)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as err:
        refused = [exc for exc, _ in err.failures.values() if isinstance(exc, RunError)]
        if reader.refused is not None or refused:
            raise reader.refused or refused[0] from None
        raise RunError(
            f"{directory}: torch.distributed.checkpoint cannot read it ({failure(err)}); is a "
            "file damaged? resume from another checkpoint (trainer.resume=PATH)"
        ) from None


def read_state(directory: Path) -> dict[str, Any]:
    """Every entry of the DCP checkpoint ``directory`` as full CPU tensors and plain data,
    in one process and without a process group (an offline export, a comparison), through
    :class:`SafeReader` and :class:`SafeLoadPlanner`: nothing in it is unpickled beyond
    tensors and plain data."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class _WholeState(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
        """The state built from the metadata (every entry whole), read safely."""

    state: dict[str, Any] = {}
    reader = SafeReader(directory)
    try:
        _load_state_dict(state, storage_reader=reader, planner=_WholeState(), no_dist=True)
    except (CheckpointException, OSError, ValueError) as err:
        if reader.refused is not None:
            raise reader.refused from None
        reason = failure(err) if isinstance(err, CheckpointException) else str(err)
        raise RunError(
            f"{directory}: torch.distributed.checkpoint cannot read it ({reason})"
        ) from None
    return state


def save(state: dict[str, Any], directory: Path) -> None:
    """``dcp.save`` of ``state`` to ``directory``; a failure on any rank (a full disk) is one
    :class:`RunError` naming the directory and the first rank's cause."""
    try:
        dcp.save(state, checkpoint_id=directory)
    except CheckpointException as err:
        raise RunError(f"{directory}: cannot be written ({failure(err)})") from None


def failure(err: CheckpointException) -> str:
    """The first failed rank's cause, in one line, and which ranks failed."""
    ranks = sorted(err.failures)
    first = err.failures[ranks[0]][0] if ranks else err
    reason = str(first).strip().splitlines()[0] if str(first).strip() else ""
    where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return f"{type(first).__name__}: {reason}{where if ranks else ''}"
