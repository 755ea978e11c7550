"""``shm``: same host, POSIX shared memory with two bucket slots; control over the store."""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets

import torch

from .._base import BucketedEngine
from .._errors import CheckpointEngineError
from .._store import blocking, connect_store, master_store, peer_errors
from .._wire import BucketMeta

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

    def prepare(self) -> dict:
        if not self.is_master:
            return {}
        token = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
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

    def _map(self, path: str) -> torch.Tensor:
        return torch.from_file(path, shared=True, size=self.bucket_size, dtype=torch.uint8)

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
        self.slots = []
        self._store = None
