"""The checkpoint-engine interface: lifecycle, versions, what an update moved."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any, ClassVar, TypeVar, overload

import torch

from ._delta import Delta, DeltaMirror, check_delta_mode
from ._errors import CheckpointEngineAborted, CheckpointEngineError
from ._positions import check_compress
from ._sizes import parse_bucket_size
from ._wire import aiter_weights

_T = TypeVar("_T")

__all__ = ["DEFAULT_TIMEOUT_S", "CheckpointEngine", "TransferStats", "Weights"]

DEFAULT_TIMEOUT_S = 300.0
"""Seconds any single wait may block before the engine raises
``CheckpointEngineTimeout`` (per wait, not per update)."""

Weights = Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True, slots=True)
class TransferStats:
    """What one ``send_weights`` moved."""

    bytes: int
    """Bytes of the weights the update carried (the model's bytes)."""
    tensors: int
    buckets: int
    seconds: float
    wire_bytes: int | None = None
    """Bytes that actually travelled (bucket bytes plus tensors read in place);
    less than ``bytes`` for a delta update. None on construction means ``bytes``."""
    base: int | None = None
    """The version a delta update was computed from; None for a dense update."""
    changed: int = 0
    """Elements that differed from the base (delta updates only)."""
    elements: int = 0
    """Elements in the update."""
    pack_seconds: float = 0.0
    """Sender time spent packing: copies into buckets, delta encoding (and the mirror's
    copy when deltas are on), not waiting for the transport."""
    delta_reason: str | None = None
    """Why this engine's ``delta="auto"`` sends dense updates from now on (e.g. on a CUDA
    device, or after a delta that saved too little), set from the update that decided it;
    None while it may send deltas, and for ``delta="on"``/``"off"``."""

    def __post_init__(self) -> None:
        if self.wire_bytes is None:
            object.__setattr__(self, "wire_bytes", self.bytes)

    @property
    def gbps(self) -> float:
        """GB/s (1e9 bytes per second) of weights updated; 0 for an empty update."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def density(self) -> float | None:
        """Fraction of elements that changed since the base (None for a dense update)."""
        if self.base is None:
            return None
        return self.changed / self.elements if self.elements else 0.0


class CheckpointEngine(abc.ABC):
    """One sender (rank 0, ``is_master=True``) and N receivers moving weight updates.

    Lifecycle on every member: ``prepare()`` (allocate; the master's returned
    metadata goes to everyone), ``init_process_group(rank=..., world_size=...,
    master_metadata=...)``, then per update ``await send_weights(...)`` on the
    master and ``async for name, tensor in receive_weights()`` on receivers,
    and ``finalize()`` at the end. A trainer rank other than the master passes
    ``rank=-1``: its calls are no-ops (``send_weights`` still iterates
    ``weights``, so collective gathers inside a generator keep working).

    The engine builds its own store and process group from the metadata and
    never touches the caller's default ``torch.distributed`` group.

    Args:
        bucket_size: bytes per bucket: an int, a string such as ``"512MiB"`` or
            ``"2GB"``, ``"auto"`` (from free memory), or ``None`` for
            :data:`rlwire.ckpt_engine.DEFAULT_BUCKET_SIZE`. The master's value is the one
            used: receivers take it from its metadata when they join.
        timeout: seconds any wait may block before raising ``CheckpointEngineTimeout``.
        checksum: send a CRC-32 per bucket and verify it on receipt.
        is_master: this member sends.
        delta: ``"off"`` (default), ``"on"`` or ``"auto"``: send only the elements
            that changed since the last update when every receiver holds it (see
            :meth:`receive_weights`' ``base_version``); costs the sender one copy of
            the weights (its mirror). ``"auto"`` stops once a delta was not smaller
            than half the dense update (e.g. fp32 weights under Adam change almost
            everywhere). Bucketed backends only (``supports_delta``); the master's
            choice holds for the group.
        compress: ``"off"`` (default) or ``"zstd"``: a delta tensor's payload travels
            zstd-compressed where that makes it smaller. It pays where the link is
            slower than compressing (about 0.3-0.5 GB/s per core at level 1): between
            hosts, not over loopback or shared memory. Needs ``delta`` on and the
            ``zstandard`` package on every member.
    """

    name: ClassVar[str] = ""
    # Capabilities, read by callers without building an engine (registry.capabilities):
    device_type: str = "cpu"
    """Where buckets live, so where ``send_weights`` wants its tensors: ``cpu``, ``cuda``
    or ``npu``. Not a ClassVar: the broadcast backends take ``device_type=`` per instance."""
    uses_store: ClassVar[bool] = False
    """Receivers connect to a TCP store on the master: pass a ``host`` they can reach."""
    zero_copy: ClassVar[bool] = False
    """``share_weights`` moves the sender's tensors into shared memory once; later updates
    send them without packing and receivers read them in place."""
    supports_delta: ClassVar[bool] = False
    """It can send lossless delta updates (``delta="on"``/``"auto"``)."""

    def __init__(
        self,
        *,
        bucket_size: int | str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        checksum: bool = False,
        is_master: bool = False,
        delta: str = "off",
        compress: str = "off",
    ) -> None:
        if not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValueError(f"timeout: {timeout!r} is not allowed; use seconds > 0")
        self.bucket_size = parse_bucket_size(bucket_size, device=self._buffer_device())
        self.timeout = float(timeout)
        self.checksum = bool(checksum)
        self.is_master = bool(is_master)
        check_delta_mode(delta)
        if delta != "off" and not self.supports_delta:
            raise ValueError(
                f"delta: {delta!r} is not offered by the {self.name} backend (it sends whole "
                "weights); use 'off', or a bucketed backend: gloo, shm, nccl, hccl, cuda_ipc"
            )
        check_compress(compress)
        if compress != "off" and delta == "off":
            raise ValueError(f"compress: {compress!r} compresses delta updates; set delta too")
        self.delta = DeltaMirror(delta if self.is_master else "off", compress=compress)
        self.rank: int | None = None
        self.world_size: int | None = None
        self._exchange = False  # members say which version they hold before each update
        self.last_version: int | None = None
        self.aborted: str | None = None
        """Why :meth:`abort` ended this engine's updates (None: it did not)."""
        self._changes: Mapping[str, Delta | None] | None = None  # send_weights' changes
        self.progressed_at = time.monotonic()
        """When a transfer of this engine last moved (``time.monotonic()``): an item taken to
        send or yielded to the receiver, or an update begun or sent. A caller that waits for a
        whole transfer running in another thread bounds its wait by the time since this, not
        by the transfer's total (which grows with the model): every wait inside is bounded
        by ``timeout`` already."""

    # --- lifecycle -----------------------------------------------------------------
    def _buffer_device(self) -> torch.device:
        return torch.device("cpu")

    @abc.abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Allocate buffers; return this member's JSON-serialisable metadata."""

    def init_process_group(
        self, *, rank: int, world_size: int, master_metadata: dict[str, Any]
    ) -> None:
        """Join the engine's own group (rank 0 sends, 1..world_size-1 receive; -1: inactive)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: {world_size!r} is not allowed; use an int >= 1")
        if not isinstance(rank, int) or not -1 <= rank < world_size:
            raise ValueError(f"rank: {rank!r} is not allowed; use -1 or 0..{world_size - 1}")
        if (rank == 0) != self.is_master:
            raise ValueError(
                f"rank {rank} with is_master={self.is_master}: the master is rank 0 and only "
                "rank 0 is the master"
            )
        self.rank, self.world_size = rank, world_size
        self._exchange = self.delta.enabled  # receivers learn it from the master below
        if rank > 0 and isinstance(master_metadata, dict):
            # The sender's choice: receivers take the master's bucket size ("auto" measured
            # on each member would disagree; slots must match what is sent).
            self.bucket_size = master_metadata.get("bucket_size", self.bucket_size)
            self._exchange = check_delta_mode(master_metadata.get("delta", "off")) != "off"
        if rank != -1:
            self._join(rank, world_size, master_metadata)

    @abc.abstractmethod
    def _join(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        """Backend-specific: connect to the group."""

    def finalize(self) -> None:
        """Free buffers and tear down the group. Idempotent; subclasses call ``super()``."""
        self.rank = self.world_size = None

    def abort(self, reason: str) -> None:
        """End the update in progress at once, and refuse any later one, from any thread:
        what a caller does when it learns that a member died (a sender waiting for a dead
        receiver's acknowledgement would otherwise wait ``timeout``). On the master it ends
        every member's waits of the update (the receivers' too); on a receiver, its own.
        Each ends with :class:`CheckpointEngineAborted` naming ``reason``; a receiver has
        applied nothing of the update. The engine is then only finalized: join a new group
        for the next update.

        Where a wait is inside a collective the engine cannot interrupt (``gloo``'s, NCCL's,
        HCCL's), it ends when the transport sees the dead peer (a gloo connection to a killed
        process closes at once) or at ``timeout``."""
        if self.aborted is None:
            self.aborted = str(reason)
        self._abort(self.aborted)

    def _abort(self, reason: str) -> None:  # noqa: B027  # optional: most backends end theirs
        """Backend: end the waits in progress (:meth:`abort` set :attr:`aborted`; a backend
        whose waits check it needs nothing more)."""

    def _check_aborted(self) -> None:
        if self.aborted is not None:
            raise CheckpointEngineAborted(
                f"{self.name}: the update was aborted ({self.aborted}); finalize this engine "
                "and join a new group"
            )

    @property
    def active(self) -> bool:
        return self.rank is not None and self.rank >= 0

    @property
    def _joined_rank(self) -> int:
        """``rank`` where the engine is joined (the backends' steps run only then)."""
        assert self.rank is not None, f"{self.name}: used before init_process_group()"
        return self.rank

    @property
    def _joined_world_size(self) -> int:
        """``world_size`` where the engine is joined (the backends' steps run only then)."""
        assert self.world_size is not None, f"{self.name}: used before init_process_group()"
        return self.world_size

    def _check_joined(self, what: str) -> None:
        if self.rank is None:
            raise CheckpointEngineError(f"{what} before init_process_group()")

    # --- updates -------------------------------------------------------------------
    async def send_weights(
        self, weights: Weights, *, version: int, changes: Mapping[str, Delta | None] | None = None
    ) -> TransferStats:
        """Send one update: every ``(name, tensor)`` of ``weights``, any dtype/shape/device.

        Returns when every receiver has consumed the whole update.

        ``changes`` (``delta`` on): what the caller already knows changed since the update
        it sent last (the one the receivers hold), per name: a
        :class:`~rlwire.ckpt_engine.Delta` (flat positions in the whole tensor, values as
        integers of the element's width, e.g. from :func:`rlwire.ckpt_engine.diff`), or
        None for a tensor that changed too much to be worth it. For those names the engine
        keeps no mirror and compares nothing: a delta update sends the change given (the
        caller answers for it being exactly the difference), a dense one sends the tensor.
        This is how a sharded trainer has each rank diff its own shard before any gather
        (verl's ``delta_sharded``). Other names are compared with the mirror as usual.

        Raises:
            CheckpointEngineError: not the master, a version lower than the
                last one sent, bad items, or a failed peer.
            CheckpointEngineTimeout: a receiver did not keep up within ``timeout``.
        """
        self._check_joined("send_weights")
        self._check_aborted()
        if not self.active:
            # Nothing to send, but iterate: a generator that gathers shards
            # collectively needs every trainer rank to take part.
            drained = [None async for _ in aiter_weights(weights)]
            del drained
            return TransferStats(0, 0, 0, 0.0)
        if self.rank != 0:
            raise CheckpointEngineError(f"send_weights on receiver rank {self.rank}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise CheckpointEngineError(f"version: {version!r} is not an int")
        if self.last_version is not None and version < self.last_version:
            raise CheckpointEngineError(
                f"version {version} is lower than the last one sent ({self.last_version})"
            )
        if changes is not None and not self.delta.enabled:
            raise CheckpointEngineError(
                f"send_weights(changes=...): this {self.name} engine sends no deltas (delta='off')"
            )
        start = time.perf_counter()
        self.progressed_at = time.monotonic()
        self._changes = changes
        try:
            stats = await self._send(self._ticked(aiter_weights(weights)), version)
        finally:
            self._changes = None
        self.last_version, self.progressed_at = version, time.monotonic()
        return dataclasses.replace(stats, seconds=time.perf_counter() - start)

    def metadata(self) -> dict[str, Any]:
        """What every member's metadata carries from the master's choices."""
        return {"bucket_size": self.bucket_size, "delta": self.delta.mode}

    @overload
    def receive_weights(
        self, *, copy: bool = True, base_version: None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]: ...

    @overload
    def receive_weights(
        self, *, copy: bool = True, base_version: int | None
    ) -> AsyncIterator[tuple[str, torch.Tensor | Delta]]: ...

    def receive_weights(
        self, *, copy: bool = True, base_version: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor | Delta]]:
        """Yield every ``(name, tensor)`` of the next update, in sending order.

        Lifetime: with ``copy=True`` (default) every tensor is owned by the
        caller. With ``copy=False`` a tensor may be a zero-copy view into the
        engine's receive buffer, valid only until the next item is requested;
        the engine then empties that view (``set_()``), so a consumer that kept
        it sees an empty tensor instead of data a later bucket overwrote. Copy
        what you need (``param.copy_(tensor)``) before asking for the next item,
        and never write into such a view (``shm`` receivers map their buffers
        read-only: a write faults; ``cuda_ipc``'s are the master's, which every
        receiver reads).
        ``last_version`` is set once the update has been fully consumed; a
        receiver must consume the whole update.

        ``base_version``: the version of the weights this receiver holds (the
        ``last_version`` of the last update it applied), to take a delta update
        when the master sends deltas: an item may then be a
        :class:`~rlwire.ckpt_engine.Delta` instead of a tensor, to be applied onto
        the held tensor of that name (``delta.apply_(tensor)``). None (default):
        every item is a whole tensor; if any receiver passes None or holds
        another version than the master's last update, the update is dense for all.
        """
        self._check_joined("receive_weights")
        if base_version is not None and (
            isinstance(base_version, bool) or not isinstance(base_version, int)
        ):
            raise CheckpointEngineError(f"base_version: {base_version!r} is not an int or None")
        if not self.active:
            return _empty()
        if self.rank == 0:
            raise CheckpointEngineError("receive_weights on the master (rank 0)")
        self._check_aborted()
        self.progressed_at = time.monotonic()
        return self._ticked(self._receive(copy, base_version))

    async def _ticked(self, items: AsyncIterator[_T]) -> AsyncIterator[_T]:
        """``items``, stamping :attr:`progressed_at` at each; closing them when the consumer
        stops early (a backend's clean-up runs then, not at garbage collection)."""
        try:
            async for item in items:
                self.progressed_at = time.monotonic()
                yield item
        finally:
            close = getattr(items, "aclose", None)  # an async generator's
            if close is not None:
                await close()

    @abc.abstractmethod
    async def _send(self, weights: Weights, version: int) -> TransferStats:
        """Backend: send; return what moved (``seconds`` is filled in by the caller)."""

    @abc.abstractmethod
    def _receive(
        self, copy: bool, base_version: int | None
    ) -> AsyncIterator[tuple[str, torch.Tensor | Delta]]:
        """Backend: yield one update (deltas only where the backend supports them)."""


async def _empty() -> AsyncIterator[tuple[str, torch.Tensor]]:
    return
    yield  # pragma: no cover
