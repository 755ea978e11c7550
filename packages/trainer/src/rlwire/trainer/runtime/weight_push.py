"""An actor rank's weights to the rollout workers through the checkpoint engine: the
sending ranks (rank 0, or every rank with rollout workers of its own: :mod:`.senders`) each
master a group of their own, the other ranks join the gathers; blocking (colocated, one-step
off) or in the background (fully async). Mixed into
:class:`~rlwire.trainer.runtime.workers.ActorWorker`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from ..config.root import TrainerConfig
from ..rollout import WeightsDigest, rollout_engine_class
from ..rollout.digest import digest_of_parts
from .background import Background, idle_budget
from .shard_deltas import ShardDeltas
from .worker_process import host

log = logging.getLogger("rlwire.trainer")

if TYPE_CHECKING:
    from rlwire.ckpt_engine import CheckpointEngine

    from ..actor import ActorEngine

__all__ = ["WeightPush"]


class WeightPush:
    """The push half of an actor rank (``ActorWorker`` sets ``config``, ``rank``, ``actor``,
    ``engine``, ``shared``, ``_sending``, ``sync_device`` and ``_resident``)."""

    config: TrainerConfig
    rank: int
    engine: CheckpointEngine | None
    """A sending rank's master from :meth:`engine_prepare`; the other ranks' (gathers only)
    from :meth:`engine_init`."""
    shared: dict[str, torch.Tensor] | None
    sync_device: torch.device
    _sending: Background
    _snapshot: tuple[int, list[tuple[str, torch.Tensor]], float, WeightsDigest | None] | None
    """A sending rank, fully async: the last push's (version, weights, gathering seconds,
    digest)."""
    _changes: dict[str, Any] | None = None
    """Rank 0, fully async: the changes of the snapshot's first send (None after it)."""
    _sends = False
    """This rank masters a group of its own (:meth:`engine_prepare`); else it only takes
    part in the gathers."""
    _laid_out = False
    """``ckpt_engine.in_place``: this group's arenas are laid out."""
    _shards: ShardDeltas | None = None
    """``ckpt_engine.delta_sharded``: this rank's copies of what the last sync sent."""

    if TYPE_CHECKING:  # ActorWorker's, declared for the type checker only

        @property
        def actor(self) -> ActorEngine: ...

        def _resident(self, *, optimizer: bool) -> AbstractContextManager[None]: ...

    # --- weights to the rollout worker -----------------------------------------------------
    def engine_prepare(self, backend: str) -> dict:
        """Become the master of a group of this rank's own (a new engine, an older group
        left); the metadata its receivers join with (:meth:`engine_init` follows)."""
        from rlwire.ckpt_engine import registry

        # Receivers of a store-controlled backend reach the master's store at this node.
        capabilities = registry.capabilities(backend)
        where = {"host": host()} if capabilities.uses_store else {}
        delta = self.config.ckpt_engine.delta
        takes = rollout_engine_class(self.config.rollout.backend).takes_deltas
        if delta == "auto" and not (capabilities.delta and takes):
            delta = "off"  # no mirror to keep when no delta can be sent
        if self.config.ckpt_engine.in_place:
            if backend != "shm":
                raise RuntimeError(
                    f"ckpt_engine.in_place needs the shm backend (one host); this run's is "
                    f"{backend!r}"
                )
            delta = "off"  # dense: a delta would apply onto the older arena's version
        self._laid_out = False  # a new engine: its arenas are laid out on its first sync
        compress = self.config.ckpt_engine.compress if delta != "off" else "off"
        self._leave_group()  # a group re-formed (a rollout worker replaced): a new master
        self._sends = True
        self.engine = engine = registry.new(
            backend,
            is_master=True,
            bucket_size=self.config.ckpt_engine.bucket_size,
            timeout=self.config.ckpt_engine.timeout,
            delta=delta,
            compress=compress,
            **where,
        )
        return engine.prepare()

    def engine_init(
        self, backend: str, world_size: int, metadata: dict, *, sends: bool | None = None
    ) -> None:
        """Join: as the master of the group :meth:`engine_prepare` made (``sends``; by
        default rank 0 alone sends), or, for a rank without receivers of its own, as a
        member that takes part in the gathers only."""
        from rlwire.ckpt_engine import registry

        if not (self.rank == 0 if sends is None else sends):
            self._leave_group()
            self._sends = False
            self.engine = engine = registry.new(
                backend,
                is_master=False,
                bucket_size=self.config.ckpt_engine.bucket_size,
                timeout=self.config.ckpt_engine.timeout,
            )
            engine.init_process_group(rank=-1, world_size=world_size, master_metadata=metadata)
            return
        self._engine().init_process_group(rank=0, world_size=world_size, master_metadata=metadata)

    def abort_push(self, reason: str) -> None:
        """A sending rank, on the ``abort`` concurrency group while a send waits on the
        default one (or runs in the background): end it at once, on every receiver too (the
        checkpoint engine's ``abort``); the group is left at the next :meth:`engine_prepare`
        or :meth:`engine_init`."""
        if self._sends and self.engine is not None:
            self.engine.abort(reason)

    def _leave_group(self) -> None:
        """Leave the checkpoint engine's group this rank joined, if any (its store, shared
        memory and buffers freed)."""
        if self.engine is not None:
            self.engine.finalize()
            self.engine = None

    def _engine(self) -> CheckpointEngine:
        """The checkpoint engine this rank joined."""
        assert self.engine is not None, f"actor rank {self.rank}: no checkpoint engine yet"
        return self.engine

    def _full_weights(self, digest: WeightsDigest | None = None):
        """(name, full tensor) for what a sync sends: every parameter and buffer, or with
        LoRA the adapter (:meth:`ActorEngine.named_sync_weights`), in the rollout engines'
        dtype (cast on the device before it leaves); a collective on every rank. ``digest``:
        each tensor added on the device it was gathered on, before it moves (nothing waits:
        :class:`~rlwire.trainer.rollout.WeightsDigest`).

        Tensors go where the engine's buckets live: the device for the CUDA backends
        (``nccl``, ``cuda_ipc``), else :attr:`sync_device` (the host, or this device for
        the hybrid engine's in-process hand-over)."""
        target = getattr(self.engine, "device", None) or self.sync_device
        # The rollout engines hold model.dtype (hf: load_hf_model; vllm: dtype=); the actor's
        # master weights may be wider (float32 under bf16: each tensor cast before it leaves).
        dtype = getattr(torch, self.config.model.dtype)
        for name, value in self.actor.named_sync_weights(dtype=dtype):
            if digest is not None:
                digest.add(name, value)
            yield name, value.to(target)

    def push_weights(self, version: int) -> dict[str, Any]:
        """Send the full weights as ``version`` (see :meth:`_push`)."""
        return asyncio.run(self._push(version))

    def _push(self, version: int) -> Coroutine[Any, Any, dict[str, Any]]:
        """Send the full weights as ``version`` (a sending rank; the others join the gathers
        and report ``{}``): a coroutine, to run alone or beside a receiver in this process
        (a method declared ``async`` would make Ray run the whole class as an async actor).

        With a zero-copy backend (``shm``) a sending rank keeps one persistent copy of the full
        weights in the engine's shared arena, laid out on the first sync: each sync copies
        every gathered tensor into its place there and sends without packing; the receivers
        read it in place."""
        digest, engine = self._digest(), self._engine()

        async def send() -> dict[str, Any]:
            start = time.perf_counter()
            with self._resident(optimizer=False):
                items, changes = self._sync_items(digest)
                stats = await engine.send_weights(items, version=version, changes=changes)
            if not self._sends:
                return {}
            # gathering the full weights (and copying them into the arena) beyond the engine
            return _report(stats, time.perf_counter() - start - stats.seconds, digest)

        return send()

    def start_push(self, version: int) -> None:
        """Send the full weights as ``version`` without holding this rank (fully-async mode):
        every rank gathers them now; each sending rank keeps them as a snapshot (the ``shm``
        arena, or a copy: one copy of the weights more on it) and sends it from a thread of its own
        while the next calls (updates) run; the rollout workers take it at their next
        boundary. One send in flight: the previous one ends before the snapshot is taken
        (the arena is its source until then; the driver finishes every push first)."""
        if not self._sends:  # the gathers only
            self.push_weights(version)
            return
        self.finish_push()
        digest = self._digest()
        start = time.perf_counter()
        with self._resident(optimizer=False):
            items, changes = self._sync_items(digest, snapshot=True)
        self._snapshot = (version, list(items), time.perf_counter() - start, digest)
        self._changes = changes
        self._send_snapshot()

    def resend_push(self, version: int) -> None:
        """Send the snapshot of ``version`` that :meth:`start_push` took again, in the
        background, to the group re-formed since (a member died during its send, or every
        member did and a replacement needs the weights the others hold): the same bytes,
        whatever updates ran since. Sending ranks only (nothing is gathered)."""
        if not self._sends:
            return
        held = self._snapshot[0] if self._snapshot is not None else None
        if held != version:
            raise RuntimeError(
                f"actor rank {self.rank}: no snapshot of version {version} (holds {held})"
            )
        from rlwire.ckpt_engine import CheckpointEngineAuthError, CheckpointEngineError

        # the send this one replaces, if its outcome (aborted, or failed with the member
        # that died) was not collected; a message a stranger wrote to the group's store is
        # no such failure: it stops the run
        try:
            self.finish_push()
        except CheckpointEngineError as failed:
            if isinstance(failed, CheckpointEngineAuthError):
                raise
            log.info("actor rank %d: the send re-sent ended: %s", self.rank, failed)
        self._send_snapshot()

    def _send_snapshot(self) -> None:
        assert self._snapshot is not None  # start_push took it
        version, snapshot, gathered_s, digest = self._snapshot
        engine = self._engine()

        changes, self._changes = self._changes, None  # a re-send: sent whole (below)
        if changes is None and self._shards is not None:  # no mirror kept for these
            changes = dict.fromkeys((name for name, _ in snapshot), None)

        async def send() -> dict[str, Any]:
            stats = await engine.send_weights(snapshot, version=version, changes=changes)
            return _report(stats, gathered_s, digest)

        self._sending.start(send, timeout=0)  # none in flight: finished before

    def finish_push(self) -> dict[str, Any]:
        """Wait for the send :meth:`start_push` began while it moves: the engine bounds each
        of its waits by ``ckpt_engine.timeout``, so a large model's send may take longer in
        all; it fails only after :func:`~.background.idle_budget` seconds without progress
        (a send stuck outside the engine's waits). What :meth:`push_weights` reports (``{}``
        on ranks that do not send)."""
        timeout = self.config.ckpt_engine.timeout
        engine = self.engine
        return (
            self._sending.finish(
                timeout=idle_budget(timeout),
                progressed_at=lambda: None if engine is None else engine.progressed_at,
                bound=f"ckpt_engine.timeout={timeout:g} s per wait, twice, and 30 s",
            )
            or {}
        )

    def _sync_items(self, digest: WeightsDigest | None, snapshot: bool = False):
        """This sync's ``(weights, changes)`` (rank 0; the others take part in the
        collectives): the whole weights gathered, or with ``ckpt_engine.delta_sharded`` the
        changes each rank found in its own shard, gathered and written into rank 0's copy
        (:class:`~.shard_deltas.ShardDeltas`). ``snapshot``: weights that outlive the call
        (fully async sends them from a thread while the next update runs)."""
        if self.config.ckpt_engine.in_place and self._sends:
            items = self._in_place(self._gathered(digest))
            if snapshot:  # the engine copies them into its arena while the next update runs
                items = [(name, value.detach().clone()) for name, value in items]
            return items, None
        shards = (
            self.actor.local_shards(dtype=getattr(torch, self.config.model.dtype))
            if self.config.ckpt_engine.delta_sharded
            else None
        )
        if shards is None:
            items = self._gathered(digest)
            if self._zero_copy():
                return self._into_arena(items), None
            if snapshot:
                return [(name, value.detach().clone()) for name, value in items], None
            return items, None
        if self._shards is None:
            self._shards = ShardDeltas(self.rank)

        def keep(whole) -> dict[str, torch.Tensor]:
            if self._zero_copy():
                return dict(self._into_arena(whole))
            return {name: value.detach().clone() for name, value in whole}

        items, changes = self._shards.collect(shards, self._full_weights, keep)
        if digest is not None:
            for name, value in items:
                digest.add(name, value)
        engine = self.engine
        if changes is not None and (engine is None or not engine.delta.enabled):
            changes = None  # delta="auto" gave up: whole weights from here on
        return items, changes

    def _in_place(self, gathered) -> list[tuple[str, torch.Tensor]]:
        """``ckpt_engine.in_place`` (rank 0): the engine's two arenas are laid out on the
        first sync of a group (the weights gathered whole once); the engine copies each
        sync into the arena no rollout engine reads."""
        items = [(name, value) for name, value in gathered]
        if not self._laid_out:
            shm = self._engine()
            shm.share_weights(items, buffers=2)  # type: ignore[attr-defined]  # shm only
            self._laid_out = True
        return items

    def _digest(self) -> WeightsDigest | None:
        """A digest to fill while gathering, with ``ckpt_engine.digest`` (a sending rank
        reports it)."""
        return WeightsDigest() if self.config.ckpt_engine.digest and self._sends else None

    def _gathered(self, digest: WeightsDigest | None):
        """:meth:`_full_weights`, added to ``digest`` on the way (on the device)."""
        return self._full_weights(digest)

    def _zero_copy(self) -> bool:
        from rlwire.ckpt_engine import registry

        return self._sends and registry.capabilities(self._engine().name).zero_copy

    def _into_arena(self, gathered) -> list[tuple[str, torch.Tensor]]:
        """Copy the gathered weights into the shared arena (laid out on first use); the
        arena's tensors, to send."""
        if self.shared is None:
            self.shared = {name: value.detach().contiguous().clone() for name, value in gathered}
            shm = self._engine()  # zero_copy: the shm backend
            shm.share_weights(self.shared.items())  # type: ignore[attr-defined]  # not on the base
        else:
            for name, value in gathered:
                self.shared[name].copy_(value)
        return list(self.shared.items())


def _report(stats, export_s: float, digest: WeightsDigest | None) -> dict[str, Any]:
    """A push's report: the engine's ``stats``, the seconds spent gathering the weights
    beyond it, and the digest of what was sent."""
    return {
        "time_weight_export_s": max(0.0, export_s),
        "weight_sync_s": stats.seconds,
        "weight_sync_gbps": stats.gbps,
        "weight_sync_bytes": stats.bytes,
        "weight_sync_wire_bytes": stats.wire_bytes,
        "weight_sync_delta_density": stats.density,
        "weight_sync_delta_reason": stats.delta_reason,
        **_digest_fields(digest),
    }


def _digest_fields(digest: WeightsDigest | None) -> dict[str, Any]:
    """The digest of what was sent and its parts, tensor by tensor (what the job compares
    with each engine's: :meth:`~..runtime.job.Job.check_weights`)."""
    if digest is None:
        return {"digest": None}
    parts = digest.parts()
    return {"digest": digest_of_parts(parts), "digest_parts": parts}
