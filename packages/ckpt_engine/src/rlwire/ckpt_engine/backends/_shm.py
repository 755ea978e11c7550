"""``shm``: same host, POSIX shared memory with two bucket slots; control over the store."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
from collections.abc import Iterable

import torch

from .._base import BucketedEngine
from .._errors import CheckpointEngineError
from .._store import blocking, connect_store, master_store, peer_errors
from .._wire import ALIGN, BucketMeta

__all__ = ["SHM_PREFIX", "ShmEngine"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "rlwire-ckpt-shm-"
"""Every segment's file name starts with this (then the master's pid), so that
segments an engine killed mid-update left behind can be found and removed."""


class ShmEngine(BucketedEngine):
    """Double-buffered shared-memory buckets on one host.

    The master packs bucket ``i`` into slot ``i % 2`` while receivers copy out
    of the other slot. Bucket metadata and per-receiver acknowledgements are
    keys in the master's TCPStore; the master reuses a slot only after every
    receiver acknowledged the bucket in it, and a receiver acknowledges only
    after its consumer moved past that bucket's last tensor. The segment files
    are unlinked as soon as every receiver has mapped them, so nothing is left
    in ``/dev/shm`` even if a process is killed later.

    Args:
        host: address of the master's store (receivers are on the same host).
    """

    name = "shm"

    def __init__(self, *, host: str = "127.0.0.1", **kwargs) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.slots = []
        self._paths: list[str] = []
        self._store = None
        self._receivers: list[int] = []
        self._pending: set[int] = set()
        self._token = ""
        # master: (arena tensor, file path or "" once unlinked); receivers: mapped arenas
        self._arenas: list[list] = []
        self._mapped: dict[int, torch.Tensor] = {}

    def prepare(self) -> dict:
        if not self.is_master:
            return {}
        token = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self._token = token
        self._paths = [os.path.join(SHM_DIR, f"{token}-slot{i}") for i in range(2)]
        for path in self._paths:
            with open(path, "wb") as f:
                f.truncate(self.bucket_size)
        self.slots = [self._map(p) for p in self._paths]
        self._store = master_store(self.host, self.timeout)
        return {
            "host": self.host,
            "port": self._store.port,
            "slots": self._paths,
            "bucket_size": self.bucket_size,
        }

    def _map(self, path: str, size: int | None = None) -> torch.Tensor:
        size = self.bucket_size if size is None else size
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    def share_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Move the master's CPU tensors into shared memory once, so updates copy them once.

        Each tensor's data moves into a new shared arena (``tensor.data`` is
        swapped: parameter objects keep their identity, optimizers and hooks
        keep working). From then on ``send_weights`` sends these tensors
        without packing them: receivers read them in place, one copy per
        receiver instead of two. The trainer must not modify them while a
        ``send_weights`` is in flight (it returns only after every receiver
        consumed the update). Bucket checksums do not cover shared tensors.

        Returns:
            Bytes moved into the arena.

        Raises:
            CheckpointEngineError: not the master, not joined, or a non-CPU tensor.
        """
        if not self.is_master or self._store is None:
            raise CheckpointEngineError("share_weights: only the master, after prepare()")
        tensors: dict[int, torch.Tensor] = {}
        for name, tensor in weights:
            if tensor.device.type != "cpu" or hasattr(tensor, "_local_tensor"):
                raise CheckpointEngineError(
                    f"share_weights: {name!r} is not a plain CPU tensor ({tensor.device})"
                )
            tensors.setdefault(id(tensor), tensor)
        offsets, total = [], 0
        for t in tensors.values():
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        index = len(self._arenas)
        path = os.path.join(SHM_DIR, f"{self._token}-arena{index}")
        with open(path, "wb") as f:
            f.truncate(max(total, 1))
        arena = self._map(path, max(total, 1))
        for t, off in zip(tensors.values(), offsets, strict=True):
            n = t.numel() * t.element_size()
            view = arena[off : off + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
        self._arenas.append([arena, path])
        self._store.set(f"arena/{index}", json.dumps([path, max(total, 1)]))
        return total

    def _in_arena(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        if not self._arenas or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        ptr = tensor.data_ptr()
        for index, (arena, _) in enumerate(self._arenas):
            base = arena.data_ptr()
            if base <= ptr < base + arena.numel():
                return index, ptr - base
        return None

    def _arena(self, arena: int) -> torch.Tensor:
        if arena not in self._mapped:
            path, size = json.loads(self._store.get(f"arena/{arena}"))
            try:
                self._mapped[arena] = self._map(path, size)
            except RuntimeError as err:
                raise CheckpointEngineError(f"shm: cannot map shared arena {path}: {err}") from err
            self._store.set(f"arena/{arena}/mapped/{self.rank}", b"1")
        return self._mapped[arena]

    def _unlink_mapped_arenas(self) -> None:
        """Unlink arena files every receiver has mapped (the mappings stay valid)."""
        for index, entry in enumerate(self._arenas):
            keys = [f"arena/{index}/mapped/{r}" for r in self._receivers]
            if entry[1] and self._store.check(keys):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry[1])
                entry[1] = ""

    def _join(self, rank: int, world_size: int, master_metadata: dict) -> None:
        self._receivers = list(range(1, world_size))
        if rank == 0:
            keys = [f"joined/{r}" for r in self._receivers]
            with peer_errors("shm: waiting for every receiver to map the slots", self.timeout):
                if keys:
                    self._store.wait(keys, datetime.timedelta(seconds=self.timeout))
            self._unlink()
            return
        if master_metadata.get("bucket_size") != self.bucket_size:
            raise CheckpointEngineError(
                f"shm: bucket_size {self.bucket_size} differs from the master's "
                f"{master_metadata.get('bucket_size')}; use the same value on every member"
            )
        self._store = connect_store(master_metadata, self.timeout)
        try:
            self.slots = [self._map(p) for p in master_metadata["slots"]]
        except (KeyError, RuntimeError) as err:
            raise CheckpointEngineError(f"shm: cannot map the master's slots: {err}") from err
        self._store.set(f"joined/{rank}", b"1")

    def _unlink(self) -> None:
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._paths = []

    async def _wait_acks(self, seq: int) -> None:
        keys = [f"ack/{seq}/{r}" for r in self._receivers]
        timeout = datetime.timedelta(seconds=self.timeout)
        await blocking(
            lambda: self._store.wait(keys, timeout),
            f"shm: waiting for receivers to consume bucket {seq}",
            self.timeout,
        )
        for key in [*keys, f"meta/{seq}"]:
            self._store.delete_key(key)
        self._pending.discard(seq)

    async def _acquire(self, slot: int, seq: int) -> None:
        if seq - 2 in self._pending:
            await self._wait_acks(seq - 2)

    async def _emit(self, slot: int, meta: BucketMeta) -> None:
        self._store.set(f"meta/{meta.index}", meta.to_bytes())
        self._pending.add(meta.index)

    async def _drain(self, last_seq: int) -> None:
        for seq in sorted(self._pending):
            await self._wait_acks(seq)
        self._unlink_mapped_arenas()

    async def _next(self, seq: int) -> tuple[BucketMeta, torch.Tensor]:
        key = f"meta/{seq}"
        timeout = datetime.timedelta(seconds=self.timeout)

        def fetch() -> bytes:
            self._store.wait([key], timeout)
            return self._store.get(key)

        meta = BucketMeta.from_bytes(
            await blocking(fetch, f"shm: waiting for bucket {seq}", self.timeout)
        )
        return meta, self.slots[seq % 2]

    async def _release(self, meta: BucketMeta) -> None:
        await blocking(
            lambda: self._store.set(f"ack/{meta.index}/{self.rank}", b"1"),
            f"shm: acknowledging bucket {meta.index}",
            self.timeout,
        )

    def finalize(self) -> None:
        super().finalize()
        self._unlink()
        for entry in self._arenas:
            if entry[1]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry[1])
        self._arenas, self._mapped = [], {}
        self.slots = []
        self._store = None
