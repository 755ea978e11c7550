"""Bucket metadata and acknowledgements over the master's TCPStore.

Shared by the backends whose data path is not itself a message stream
(shared memory, CUDA IPC, NCCL broadcasts): the master publishes each
bucket's metadata under ``meta/<seq>``; a receiver acknowledges with
``ack/<seq>/<rank>`` once its consumer is done with the bucket; the master
reuses the slot of bucket ``seq`` only after every receiver acknowledged
bucket ``seq - 2``, and an update ends when every receiver acknowledged its
last bucket.
"""

from __future__ import annotations

import abc
import datetime
import json
from typing import Any

import torch

from ._bucketed import BucketedEngine
from ._errors import CheckpointEngineError
from ._store import SignedStore, blocking, connect_store, master_store, peer_errors
from ._wire import BucketMeta

__all__ = ["StoreControlledEngine", "accelerator_device", "cuda_device"]


def accelerator_device(
    device: torch.device | str | None, device_type: str, backend: str
) -> torch.device:
    """``device`` (default: the current device of ``device_type``), or an error if there is none.

    ``device_type`` is ``cuda``, ``npu`` (torch_npu's ``torch.npu``) or ``cpu``.
    """
    module = getattr(torch, device_type, None)
    if device_type != "cpu" and (module is None or not module.is_available()):
        raise CheckpointEngineError(
            f"{backend} needs a {device_type.upper()} device; none is available"
        )
    device = torch.device(device_type) if device is None else torch.device(device)
    if device.type != device_type:
        raise CheckpointEngineError(
            f"{backend}: device {device} is not a {device_type.upper()} device"
        )
    if device.index is None and device_type != "cpu":  # "cuda" means the current device
        device = torch.device(device_type, module.current_device())
    return device


def cuda_device(device: torch.device | str | None, backend: str) -> torch.device:
    """``device`` (default: the current CUDA device), or an error if there is no CUDA."""
    return accelerator_device(device, "cuda", backend)


class StoreControlledEngine(BucketedEngine):
    """A bucketed engine whose control messages go through the master's store.

    Subclasses provide the slots (``_create_slots`` on the master,
    ``_attach_slots`` on receivers) and may hook the points where data must
    be complete: before a bucket is published and before it is acknowledged.

    Args:
        host: address receivers use to reach the master's store.
    """

    uses_store = True
    supports_delta = True

    def __init__(self, *, host: str = "127.0.0.1", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.slots = []
        self._store: SignedStore | None = None
        self._receivers: list[int] = []
        self._pending: set[int] = set()

    @property
    def _joined_store(self) -> SignedStore:
        """The master's store: made by ``prepare()`` on the master, reached in
        ``init_process_group()`` on receivers; every use comes after those."""
        assert self._store is not None, f"{self.name}: the store is used before it exists"
        return self._store

    # --- slots (subclass hooks) ---------------------------------------------------------
    @abc.abstractmethod
    def _create_slots(self) -> dict[str, Any]:
        """Master: allocate ``self.slots``; return what receivers need to attach."""

    @abc.abstractmethod
    def _attach_slots(self, master_metadata: dict[str, Any]) -> None:
        """Receiver: make ``self.slots`` usable from ``master_metadata``."""

    def _publish_slots(self, receivers: list[int]) -> None:
        """Master: per-receiver attachment data, through the store (before they attach)."""

    def _all_attached(self) -> None:
        """Master: every receiver has attached (e.g. unlink names nobody needs now)."""

    def _release_slots(self) -> None:
        """Free the slots (finalize)."""
        self.slots = []

    async def _before_publish(self, slot: int, meta: BucketMeta) -> None:
        """Master: make the slot's bytes visible to receivers before announcing them."""

    async def _after_publish(self, slot: int, meta: BucketMeta) -> None:
        """Master: move the bytes if the transport needs a collective (NCCL)."""

    async def _receive_into(self, meta: BucketMeta) -> torch.Tensor:
        """Receiver: the buffer holding bucket ``meta`` (default: the shared slot)."""
        return self.slots[meta.index % 2]

    async def _before_ack(self, meta: BucketMeta) -> None:
        """Receiver: the consumer's reads of the bucket must be complete before the ack."""

    # --- lifecycle ----------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        self._store = master_store(self.host, self.timeout, self.name)  # first: a bad host
        metadata = self._create_slots()  # leaves no slot
        return {**self._store.metadata(self.host), **self.metadata(), **metadata}

    def _join(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        self._receivers = list(range(1, world_size))
        if rank == 0:
            self._publish_slots(self._receivers)
            keys = [f"joined/{r}" for r in self._receivers]
            with peer_errors(f"{self.name}: waiting for every receiver to join", self.timeout):
                self._joined_store.wait_get(keys, datetime.timedelta(seconds=self.timeout))
            self._all_attached()
            return
        self._store = connect_store(master_metadata, self.timeout, self.name)
        self._attach_slots(master_metadata)
        self._store.set(f"joined/{rank}", b"1")

    def finalize(self) -> None:
        super().finalize()
        self._release_slots()
        self._store = None

    def _abort(self, reason: str) -> None:
        store = self._store
        if store is None:  # not joined: nothing waits
            return
        # The master also ends the receivers' waits: each waits for the metadata of the
        # bucket after the last one it took, at most one past the last one published.
        ahead = [f"meta/{self._seq}", f"meta/{self._seq + 1}"] if self.is_master else []
        store.abort(reason, also=ahead)

    # --- the protocol -------------------------------------------------------------------
    async def _exchange_held(self, held: int | None) -> list[int | None]:
        # Keyed by the first bucket of the update, which every member knows.
        prefix = f"held/{self._seq}"
        if self.rank != 0:
            await blocking(
                lambda: self._joined_store.set(f"{prefix}/{self.rank}", json.dumps(held)),
                f"{self.name}: saying which version this receiver holds",
                self.timeout,
            )
            return []
        keys = [f"{prefix}/{r}" for r in self._receivers]

        def collect() -> list[int | None]:
            raw = self._joined_store.wait_get(keys, datetime.timedelta(seconds=self.timeout))
            answers: list[int | None] = [json.loads(value) for value in raw]
            for k in keys:
                self._joined_store.delete_key(k)
            return answers

        return await blocking(
            collect, f"{self.name}: asking every receiver which version it holds", self.timeout
        )

    async def _wait_acks(self, seq: int) -> None:
        keys = [f"ack/{seq}/{r}" for r in self._receivers]
        timeout = datetime.timedelta(seconds=self.timeout)
        await blocking(  # verified: a forged ack would let the slot be overwritten early
            lambda: self._joined_store.wait_get(keys, timeout),
            f"{self.name}: waiting for receivers to consume bucket {seq}",
            self.timeout,
        )
        for key in [*keys, f"meta/{seq}"]:
            self._joined_store.delete_key(key)
        self._pending.discard(seq)

    async def _acquire(self, slot: int, seq: int) -> None:
        if seq - 2 in self._pending:
            await self._wait_acks(seq - 2)

    async def _emit(self, slot: int, meta: BucketMeta) -> None:
        await self._before_publish(slot, meta)
        self._joined_store.set(f"meta/{meta.index}", meta.to_bytes())
        self._pending.add(meta.index)
        await self._after_publish(slot, meta)

    async def _drain(self, last_seq: int) -> None:
        for seq in sorted(self._pending):
            await self._wait_acks(seq)

    async def _next(self, seq: int) -> tuple[BucketMeta, torch.Tensor]:
        key = f"meta/{seq}"
        timeout = datetime.timedelta(seconds=self.timeout)

        def fetch() -> bytes:
            return self._joined_store.wait_get([key], timeout)[0]

        raw = await blocking(fetch, f"{self.name}: waiting for bucket {seq}", self.timeout)
        meta = BucketMeta.from_bytes(raw)
        return meta, await self._receive_into(meta)

    async def _release(self, meta: BucketMeta) -> None:
        await self._before_ack(meta)
        await blocking(
            lambda: self._joined_store.set(f"ack/{meta.index}/{self.rank}", b"1"),
            f"{self.name}: acknowledging bucket {meta.index}",
            self.timeout,
        )
