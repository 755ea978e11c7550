"""``gloo``: torch.distributed gloo over TCP; CPU buckets; works across hosts."""

from __future__ import annotations

import datetime
import ipaddress
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from .._bucketed import BucketedEngine
from .._errors import CheckpointEngineError
from .._store import SignedStore, blocking, connect_store, master_store, peer_errors
from .._wire import MAX_META_BYTES, BucketMeta, to_bytes

__all__ = ["GlooEngine", "gloo_options"]

_NONE = -(2**63)  # "holds no usable version" in the version exchange


def gloo_options(store_host: str, timeout: float) -> Any:
    """The gloo group's options: its pairs listen on loopback when the store does.

    gloo's default device listens on the address the machine's hostname resolves to, so a
    group whose members all reach the store at loopback (one host) would still accept
    connections from the network, and gloo pairs are not authenticated. Across hosts the
    default device stays: each member listens on its own routable address. Returns a
    ``ProcessGroupGloo._Options`` (torch's stub does not declare it)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stub
    options._timeout = datetime.timedelta(seconds=timeout)
    if _is_loopback(store_host):
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=store_host)]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return options


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _GlooGroup(Protocol):
    """The collectives used here of ``dist.ProcessGroupGloo``, which torch's stub declares
    as a bare ``Backend`` without them."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
    ) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...


class GlooEngine(BucketedEngine):
    """Broadcast buckets in the engine's own gloo group (rank 0 to all).

    Each bucket is three broadcasts: a header (metadata length, data length),
    the metadata, and the used bytes of the bucket; the data broadcast of one
    bucket overlaps the packing of the next (two slots). The update ends with
    an all-reduce that every receiver joins after consuming the last tensor.

    Args:
        host: address receivers use to reach the master's store (set it to a
            routable address for cross-host groups).
    """

    name = "gloo"
    uses_store = True
    supports_delta = True

    def __init__(self, *, host: str = "127.0.0.1", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host = host
        self.slots = []
        self._store: SignedStore | None = None
        self._pg: _GlooGroup | None = None
        self._inflight: list[dist.Work | None] = [None, None]

    def prepare(self) -> dict[str, Any]:
        self.slots = [torch.empty(self.bucket_size, dtype=torch.uint8) for _ in range(2)]
        if not self.is_master:
            return {}
        self._store = master_store(self.host, self.timeout, self.name)
        return {**self._store.metadata(self.host), **self.metadata()}

    def _join(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        if not self.slots or self.slots[0].numel() != self.bucket_size:
            self.prepare()
        if self._store is None:
            self._store = connect_store(master_metadata, self.timeout, self.name)
        with peer_errors("forming the gloo group", self.timeout):
            self._pg = dist.ProcessGroupGloo(  # type: ignore[assignment]  # stub lacks collectives
                PrefixStore("rlwire-ckpt/gloo", self._store.raw),
                rank,
                world_size,
                gloo_options(self._store.raw.host, self.timeout),
            )

    @property
    def _group(self) -> _GlooGroup:
        assert self._pg is not None, "gloo: used before init_process_group()"
        return self._pg

    def _bcast(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self._group.broadcast([tensor], opts)

    def _wait(self, work: dist.Work) -> None:
        work.wait(datetime.timedelta(seconds=self.timeout))

    async def _exchange_held(self, held: int | None) -> list[int | None]:
        mine = torch.tensor([_NONE if held is None else held], dtype=torch.int64)
        every = [torch.empty(1, dtype=torch.int64) for _ in range(self._joined_world_size)]
        await blocking(
            lambda: self._wait(self._group.allgather([every], [mine])),
            "gloo: asking every receiver which version it holds",
            self.timeout,
        )
        return [None if int(t) == _NONE else int(t) for t in every[1:]]

    async def _acquire(self, slot: int, seq: int) -> None:
        work, self._inflight[slot] = self._inflight[slot], None
        if work is not None:
            await blocking(lambda: self._wait(work), "gloo: sending a bucket", self.timeout)

    async def _emit(self, slot: int, meta: BucketMeta) -> None:
        assert self._store is not None  # made or reached in init_process_group()
        raw = self._store.sign(f"meta/{meta.index}", meta.to_bytes())
        header = torch.tensor([len(raw), meta.nbytes], dtype=torch.int64)
        body = torch.frombuffer(bytearray(raw), dtype=torch.uint8)

        def send_meta() -> None:
            self._wait(self._bcast(header))
            self._wait(self._bcast(body))

        await blocking(send_meta, f"gloo: sending bucket {meta.index} metadata", self.timeout)
        self._inflight[slot] = self._bcast(self.slots[slot][: meta.nbytes])

    async def _drain(self, last_seq: int) -> None:
        for slot in range(2):
            await self._acquire(slot, last_seq)
        await self._ack()

    async def _ack(self) -> None:
        done = torch.ones(1)
        await blocking(
            lambda: self._wait(self._group.allreduce([done])),
            "gloo: waiting for every receiver to finish the update",
            self.timeout,
        )

    async def _next(self, seq: int) -> tuple[BucketMeta, torch.Tensor]:
        buf = self.slots[seq % 2]

        def recv() -> BucketMeta:
            header = torch.empty(2, dtype=torch.int64)
            self._wait(self._bcast(header))
            size = int(header[0])
            if not 0 < size <= MAX_META_BYTES:  # before anything is allocated for it
                raise CheckpointEngineError(
                    f"gloo: bucket {seq}'s metadata claims {size} bytes (at most {MAX_META_BYTES})"
                )
            body = torch.empty(size, dtype=torch.uint8)
            self._wait(self._bcast(body))
            assert self._store is not None  # made or reached in init_process_group()
            meta = BucketMeta.from_bytes(self._store.verify(f"meta/{seq}", to_bytes(body)))
            if meta.nbytes > buf.numel():
                raise CheckpointEngineError(
                    f"gloo: bucket {seq} claims {meta.nbytes} bytes, over this receiver's "
                    f"bucket of {buf.numel()}"
                )
            self._wait(self._bcast(buf[: meta.nbytes]))
            return meta

        meta = await blocking(recv, f"gloo: receiving bucket {seq}", self.timeout)
        return meta, buf

    async def _release(self, meta: BucketMeta) -> None:
        if meta.last:
            await self._ack()

    def _abort(self, reason: str) -> None:
        # The store's waits (joining, the delta exchange) end at once; the collectives'
        # when a dead peer's connections close, which gloo sees at once.
        if self._store is not None:
            self._store.abort(reason)

    def finalize(self) -> None:
        super().finalize()
        self._pg = None
        self._store = None
        self.slots = []
