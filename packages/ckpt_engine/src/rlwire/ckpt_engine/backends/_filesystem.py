"""``filesystem``: safetensors shards plus a manifest, published atomically per version."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import stat
import time
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any, TypeVar

import torch

from .._base import CheckpointEngine, TransferStats, Weights
from .._errors import CheckpointEngineAborted, CheckpointEngineError, CheckpointEngineTimeout
from .._wire import aiter_weights, as_bytes, checksum, dtype_from_name, dtype_name

__all__ = ["FilesystemEngine"]

MANIFEST = "manifest.json"
MARKER = "COMPLETE"
ABORTED = "ABORTED"
"""The file the master's :meth:`~rlwire.ckpt_engine.CheckpointEngine.abort` writes in the
root (its reason inside): every member's waits end when they see it."""
_VERSION_DIR = re.compile(r"^v(\d+)$")
_T = TypeVar("_T")


def _safetensors() -> ModuleType:
    try:
        import numpy  # noqa: F401  (safetensors.torch needs it to write files)
        import safetensors.torch
    except ImportError as err:
        raise ImportError(
            "the filesystem checkpoint engine needs safetensors: "
            "pip install 'rlwire-ckpt-engine[filesystem]'"
        ) from err
    return safetensors.torch


def private_root(path: str, *, create: bool) -> str:
    """``path`` resolved (symlinks followed), refused unless only this process's user can
    use it: a directory owned by the effective uid whose mode gives group and others
    nothing (``mode & 0o077 == 0``). Whoever can write the root can hand every receiver
    weights of their own, and whoever can read it reads the model.

    With ``create``, a missing root is made first: the leaf with mode ``0o700`` (and set to
    it whatever the umask), its missing parents with the default mode. Only the leaf needs
    it: nobody else can list, create, replace or read anything inside it. (A parent that
    others may write without the sticky bit would let them rename the leaf away; ``/tmp``'s
    sticky bit forbids that.) The check applies to what the path resolves to, so a symlink
    to a private directory passes and one to anything else does not; the engine then works
    in the resolved directory, so a link changed later is not followed.
    """
    if create:
        # an existing root (or another member's, made meanwhile) is left as it is: checked below
        with contextlib.suppress(FileExistsError):
            os.makedirs(path, mode=0o700)
            os.chmod(path, 0o700)  # the umask may have taken the owner's bits too
    real = os.path.realpath(path)
    shown = repr(path) if real == os.path.abspath(path) else f"{path!r} (-> {real!r})"
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise CheckpointEngineError(f"filesystem: root {shown} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointEngineError(f"filesystem: root {shown} is not a directory")
    uid, mode = os.geteuid(), stat.S_IMODE(info.st_mode)
    if info.st_uid != uid or mode & 0o077:
        raise CheckpointEngineError(
            f"filesystem: root {shown} is owned by uid {info.st_uid} with mode {mode:#o}; it "
            f"must be owned by this process's user (uid {uid}) and closed to group and others "
            f"(whoever can write it can hand the receivers weights): chmod 700 {real} (as its "
            "owner), or give a root of your own that does not exist yet"
        )
    return real


class FilesystemEngine(CheckpointEngine):
    """Weights as safetensors shards under ``<root>/v<version>/``; a durable snapshot too.

    The master writes shards of at most ``bucket_size`` bytes (a larger tensor
    is split into ``uint8`` chunks stored as ``<name>@chunk<k>``) and
    ``manifest.json`` (names, dtypes, shapes, chunks, per-tensor CRC-32 when
    ``checksum``, version) into a temporary directory, renames it to
    ``v<version>`` and writes the ``COMPLETE`` marker last: a directory without
    the marker is never read. Receivers wait for the newest complete version
    above the last one they read, load the shards memory-mapped, and leave an
    ``ack-rank<r>`` file that the master waits for. The master keeps the last
    ``keep`` versions. Works over any shared filesystem.

    Args:
        root: the directory (shared by all members). Only this process's user may use it:
            an existing root owned by another uid, or whose mode gives group or others any
            permission, is refused with :class:`CheckpointEngineError` (``chmod 700`` it, or
            give another root); a missing one is made with mode ``0o700``
            (:func:`private_root`).
        keep: complete versions to keep (>= 1).
        poll_interval: seconds between directory scans while waiting.
    """

    name = "filesystem"

    def __init__(
        self,
        *,
        root: str | os.PathLike[str],
        keep: int = 2,
        poll_interval: float = 0.01,
        **kwargs: Any,
    ) -> None:
        _safetensors()
        super().__init__(**kwargs)
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: {keep!r} is not allowed; use an int >= 1")
        self.root = os.fspath(root)
        self.keep = keep
        self.poll_interval = poll_interval

    def prepare(self) -> dict[str, Any]:
        given, self.root = self.root, private_root(self.root, create=True)
        if self.is_master:  # a new group: an earlier one's abort is not this one's
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.root, ABORTED))
        # the path as given: another host may reach the shared directory by other links
        return {"root": given} if self.is_master else {}

    def _join(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        if rank > 0 and "root" in master_metadata:  # the master made it: checked here too
            self.root = private_root(master_metadata["root"], create=False)

    def _versions(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = [int(m[1]) for n in names if (m := _VERSION_DIR.match(n))]
        return sorted(v for v in found if os.path.exists(os.path.join(self.root, f"v{v}", MARKER)))

    async def _wait_for(self, predicate: Callable[[], _T | None], what: str) -> _T:
        deadline = time.monotonic() + self.timeout
        while (result := predicate()) is None:
            self._check_aborted()
            reason = self._abort_reason()
            if reason is not None:
                raise CheckpointEngineAborted(f"filesystem: the update was aborted: {reason}")
            if time.monotonic() > deadline:
                raise CheckpointEngineTimeout(f"filesystem: {what} within {self.timeout:g} s")
            await asyncio.sleep(self.poll_interval)
        return result

    def _abort_reason(self) -> str | None:
        """The reason in the master's ``ABORTED`` file (None: the update was not aborted)."""
        try:
            with open(os.path.join(self.root, ABORTED)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _abort(self, reason: str) -> None:
        if not (self.is_master and self.active):  # a receiver's own waits see the flag
            return
        path = os.path.join(self.root, ABORTED)
        with open(f"{path}.tmp", "w") as f:
            f.write(reason)
        os.replace(f"{path}.tmp", path)

    async def _send(self, weights: Weights, version: int) -> TransferStats:
        st = _safetensors()
        final = os.path.join(self.root, f"v{version}")
        tmp = os.path.join(self.root, f".v{version}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        entries: list[dict[str, Any]] = []
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, shards, nbytes, tensors = 0, 0, 0, 0

        def write_shard() -> None:
            nonlocal shard, shard_bytes, shards
            if shard:
                st.save_file(
                    shard,
                    os.path.join(tmp, f"shard-{shards:05d}.safetensors"),
                    metadata={"version": str(version)},
                )
                shards += 1
            shard, shard_bytes = {}, 0

        async for name, tensor in aiter_weights(weights):
            t = tensor.detach().to("cpu").contiguous()
            raw = as_bytes(t)
            entry: dict[str, Any] = {
                "name": name,
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "crc32": checksum(raw) if self.checksum else None,
                "parts": [],
            }
            if raw.numel() <= self.bucket_size:
                if shard_bytes + raw.numel() > self.bucket_size:
                    write_shard()
                shard[name] = t
                shard_bytes += raw.numel()
                entry["parts"].append([shards, name, 0, raw.numel()])
            else:
                for k, start in enumerate(range(0, raw.numel(), self.bucket_size)):
                    write_shard()
                    key = f"{name}@chunk{k}"
                    part = raw[start : start + self.bucket_size]
                    shard[key] = part.clone()
                    entry["parts"].append([shards, key, start, part.numel()])
                    write_shard()
            entries.append(entry)
            nbytes += raw.numel()
            tensors += 1
        write_shard()
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"version": version, "shards": shards, "tensors": entries}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        with open(os.path.join(final, f".{MARKER}.tmp"), "w") as f:
            f.write(str(version))
        os.replace(os.path.join(final, f".{MARKER}.tmp"), os.path.join(final, MARKER))
        receivers = range(1, self._joined_world_size)
        await self._wait_for(
            lambda: (
                True
                if all(os.path.exists(os.path.join(final, f"ack-rank{r}")) for r in receivers)
                else None
            ),
            f"receivers {[r for r in receivers]} did not acknowledge version {version}",
        )
        for old in self._versions()[: -self.keep]:
            shutil.rmtree(os.path.join(self.root, f"v{old}"), ignore_errors=True)
        return TransferStats(nbytes, tensors, shards, 0.0)

    async def _receive(
        self, copy: bool, base_version: int | None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        st = _safetensors()
        last = self.last_version if self.last_version is not None else -1

        def newest() -> int | None:
            newer = [v for v in self._versions() if v > last]
            return newer[-1] if newer else None

        version = await self._wait_for(newest, f"no version newer than {last} appeared")
        folder = os.path.join(self.root, f"v{version}")
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
        opened: dict[int, dict[str, torch.Tensor]] = {}

        def shard(i: int) -> dict[str, torch.Tensor]:
            if i not in opened:
                opened[i] = st.load_file(os.path.join(folder, f"shard-{i:05d}.safetensors"))
            return opened[i]

        for entry in manifest["tensors"]:
            dtype = dtype_from_name(entry["dtype"], f"filesystem: version {version}'s manifest")
            parts = entry["parts"]
            if (
                len(parts) == 1
                and parts[0][2] == 0
                and shard(parts[0][0])[parts[0][1]].dtype == dtype
            ):
                tensor = shard(parts[0][0]).pop(parts[0][1]).reshape(entry["shape"])
            else:
                total = sum(p[3] for p in parts)
                buf = torch.empty(total, dtype=torch.uint8)
                for index, key, start, length in parts:
                    buf[start : start + length].copy_(shard(index).pop(key).view(-1))
                tensor = buf.view(dtype).view(entry["shape"])
            if entry["crc32"] is not None:
                actual = checksum(as_bytes(tensor))
                if actual != entry["crc32"]:
                    raise CheckpointEngineError(
                        f"filesystem: version {version}, tensor {entry['name']!r} is corrupted: "
                        f"checksum {actual:#010x} != {entry['crc32']:#010x}"
                    )
            yield entry["name"], tensor
        with open(os.path.join(folder, f"ack-rank{self.rank}"), "w") as f:
            f.write("1")
        self.last_version = version
