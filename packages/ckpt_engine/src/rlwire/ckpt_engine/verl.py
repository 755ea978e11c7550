"""rlwire's checkpoint-engine backends inside verl (installed beside verl; 0.9.1 tested).

Importing this module registers ``rlwire_gloo``, ``rlwire_shm``, ``rlwire_filesystem``,
``rlwire_nccl``, ``rlwire_cuda_ipc`` and ``rlwire_hccl`` in verl's
``CheckpointEngineRegistry``. The package declares it as a ``verl.plugins`` entry point, so
a plain ``import verl`` registers them in every process; a verl user switches with one line:

    actor_rollout_ref.rollout.checkpoint_engine.backend=rlwire_shm

Options go through verl's ``engine_kwargs`` for that name: ``timeout`` and ``checksum`` (as
in :class:`rlwire.ckpt_engine.CheckpointEngine`), ``rlwire_bucket_size`` (anything
:func:`rlwire.ckpt_engine.parse_bucket_size` takes, ``"auto"`` included; verl's own
``bucket_size`` keyword is already taken by ``update_weights_bucket_megabytes``),
``rebuild_group`` (verl's meaning: tear the group down after every update and build it
again; default false: built on the first update and kept), ``host`` (where receivers reach
a store-controlled master; default: ``MASTER_ADDR``, which verl's worker group sets to actor
rank 0's node address, else loopback) and any option of the rlwire backend itself.

How verl's lifecycle maps onto rlwire's, per update: ``prepare`` (the master builds and
prepares its engine; the metadata of actor rank 0 is the one that counts), the class's
``build_topology`` (actor rank 0 is rlwire's master, rank 0; the other actor ranks are
inactive members, rank -1, that still iterate the weights so collective gathers run;
rollout rank i is receiver 1 + i), ``init_process_group``, ``send_weights`` /
``receive_weights`` (verl's ``global_steps`` is rlwire's version, checked on receipt;
``TransferStats`` becomes verl's metrics dict) and ``finalize``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import torch

try:
    from verl.checkpoint_engine.base import CheckpointEngine as VerlCheckpointEngine
    from verl.checkpoint_engine.base import CheckpointEngineRegistry as VerlRegistry
except ImportError as err:  # pragma: no cover - the module's whole point
    raise ImportError(
        f"rlwire.ckpt_engine.verl needs verl: pip install 'verl>=0.9.1' ({err})"
    ) from None

from ._base import DEFAULT_TIMEOUT_S, CheckpointEngine, TransferStats, Weights
from ._errors import CheckpointEngineError
from ._registry import registry

__all__ = ["BACKENDS", "VerlAdapter", "verl_name"]

BACKENDS = ("gloo", "shm", "filesystem", "nccl", "cuda_ipc", "hccl")
"""The rlwire backends offered to verl, each as ``rlwire_<name>``."""

_OWN_OPTIONS = ("rebuild_group", "host", "rlwire_bucket_size")


def verl_name(backend: str) -> str:
    return f"rlwire_{backend}"


def _host() -> str:
    """Where receivers reach the master: the address verl's worker group gives actor rank 0
    for its own process group (``MASTER_ADDR``, rank 0's node), else loopback."""
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


class VerlAdapter(VerlCheckpointEngine):
    """A verl ``CheckpointEngine`` running one rlwire backend (:attr:`backend`)."""

    backend: ClassVar[str] = ""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.is_master = bool(is_master)
        self.rebuild_group = bool(engine_kwargs.pop("rebuild_group", False))
        self.host = engine_kwargs.pop("host", None)
        bucket = engine_kwargs.pop("rlwire_bucket_size", None)
        self.options: dict[str, Any] = {
            "bucket_size": bucket if bucket is not None else int(bucket_size),
            "timeout": engine_kwargs.pop("timeout", DEFAULT_TIMEOUT_S),
            "checksum": bool(engine_kwargs.pop("checksum", False)),
            **engine_kwargs,
        }
        self.engine: CheckpointEngine | None = None
        self.metadata: dict[str, Any] | None = None
        self.joined: tuple[int, int] | None = None
        self.steps = 0

    def _engine(self) -> CheckpointEngine:
        if self.engine is None:
            self.engine = registry.new(self.backend, is_master=self.is_master, **self.options)
        return self.engine

    # --- verl's lifecycle -----------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """The master builds and prepares its engine; others prepare when they know their
        role (in :meth:`init_process_group`): an inactive actor rank allocates nothing."""
        if not self.is_master:
            return {}
        if self.metadata is None:
            if registry.capabilities(self.backend).uses_store:  # receivers connect here
                self.options["host"] = self.host or _host()
            self.metadata = self._engine().prepare()
        return self.metadata

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 sends (rank 0), other actor ranks are inactive (-1), rollout rank i
        receives as 1 + i; everyone gets actor rank 0's metadata."""
        world = 1 + rollout_world_size
        master = metadata[0]
        actor: dict[str, list[Any]] = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world] * actor_wg_world_size,
            "master_metadata": [master] * actor_wg_world_size,
        }
        rollout: dict[str, list[Any]] = {
            "rank": list(range(1, world)),
            "world_size": [world] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(
        self, *, rank: int, world_size: int, master_metadata: dict[str, Any]
    ) -> None:
        if self.joined is not None:  # kept from an earlier update (rebuild_group false)
            if self.joined != (rank, world_size):
                raise CheckpointEngineError(
                    f"{verl_name(self.backend)}: rank {rank} of {world_size} differs from the "
                    f"kept group's {self.joined}; set rebuild_group=true to rebuild it"
                )
            return
        engine = self._engine()
        if rank > 0:
            engine.prepare()
        engine.init_process_group(rank=rank, world_size=world_size, master_metadata=master_metadata)
        self.joined = (rank, world_size)

    def finalize(self) -> None:
        """With ``rebuild_group``: tear the group down (the next update builds a new one)."""
        if self.rebuild_group and self.engine is not None:
            self.engine.finalize()
            self.engine, self.metadata, self.joined = None, None, None

    async def send_weights(
        self, weights: Weights, global_steps: int | None = None
    ) -> dict[str, float]:
        """Send ``weights`` as version ``global_steps``; verl's metrics dict (actor rank 0
        only: the others return nothing, so verl's merge keeps rank 0's numbers)."""
        engine = self._engine()
        stats: TransferStats = await engine.send_weights(
            weights, version=self._version(global_steps)
        )
        if not engine.active:
            return {}
        prefix = f"checkpoint_engine/{verl_name(self.backend)}"
        return {
            f"{prefix}/bytes": stats.bytes,
            f"{prefix}/tensors": stats.tensors,
            f"{prefix}/buckets": stats.buckets,
            f"{prefix}/seconds": stats.seconds,
            f"{prefix}/gbps": stats.gbps,
        }

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every ``(name, tensor)`` of the update (owned tensors); the version that arrives
        must be ``global_steps`` when verl gives one."""
        engine = self._engine()
        expected = self._version(global_steps)
        async for name, tensor in engine.receive_weights(copy=True):
            yield name, tensor
        if global_steps is not None and engine.last_version != expected:
            raise CheckpointEngineError(
                f"{verl_name(self.backend)}: received version {engine.last_version}, "
                f"expected global_steps {expected}"
            )

    def _version(self, global_steps: int | None) -> int:
        """verl's ``global_steps``, or this engine's own count of updates when it has none."""
        self.steps = int(global_steps) if global_steps is not None else self.steps + 1
        return self.steps


def _register() -> None:
    for backend in BACKENDS:
        name = verl_name(backend)
        existing = VerlRegistry._registry.get(name)
        if existing is not None and getattr(existing, "backend", None) == backend:
            continue  # already ours (this module imported twice)
        adapter = type(
            f"Verl{backend.title().replace('_', '')}Adapter",
            (VerlAdapter,),
            {"backend": backend, "__module__": __name__},
        )
        VerlRegistry.register(name)(adapter)


_register()
