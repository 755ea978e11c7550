"""Who sends the weights to which rollout engine, over which backend: the send plan.

Two shapes (``ckpt_engine.per_rank``):

- **rank 0**: actor rank 0 sends to every rollout worker; the other ranks only take part in
  the gathers. One checkpoint-engine group.
- **per rank**: every actor rank gathers the full tensors anyway (FSDP's ``full_tensor``
  is a collective), so each one sends to the rollout workers on its own GPU, all ranks at
  once (verl's hybrid engine hands each GPU's engine its weights the same way): one group
  per sending rank, that rank its master, its engines the receivers. On GPUs the members of
  a group share one device, so ``auto`` takes ``cuda_ipc``: no byte passes through the host
  and no rank waits for another's engines. On CPUs rollout worker ``j`` belongs to rank
  ``j % world_size`` and the groups use the one host's ``shm``.

``auto`` (``per_rank: null``) is per rank on GPUs whenever every rollout worker shares a GPU
with an actor rank, and rank 0 otherwise (on CPUs every copy passes through the same host
memory whoever makes it). ``delta_sharded`` and ``in_place`` keep rank 0: both are designs
around rank 0's one copy of the whole weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config.root import TrainerConfig
from ..errors import RunError
from .cluster import GpuLayout, engine_backend

__all__ = ["SendPlan", "merge_reports", "send_plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class SendPlan:
    """The actor rank that sends to each rollout worker, and the backend of every group."""

    senders: tuple[int, ...]
    """``senders[j]``: the actor rank that sends to rollout worker ``j``."""
    backend: str
    """The checkpoint engine's backend, the same in every group."""
    why: str
    """Why this shape and backend (the run's log says it once)."""

    @property
    def per_rank(self) -> bool:
        return any(self.senders)

    def groups(self, members: list[int]) -> dict[int, list[int]]:
        """Sending rank -> the rollout workers of ``members`` it sends to, by rank order
        (the k-th of them joins its group as rank ``1 + k``). Ranks with no member in
        ``members`` are absent: they take part in the gathers only; rank 0 alone masters the
        one group of a rank-0 plan, even an empty one."""
        if not self.per_rank:
            return {0: list(members)}
        groups: dict[int, list[int]] = {}
        for j in members:
            groups.setdefault(self.senders[j], []).append(j)
        return dict(sorted(groups.items()))

    def describe(self, members: list[int]) -> str:
        """One line for the log: which rank sends to which engines over which backend."""
        parts = [
            f"actor rank {rank} -> rollout worker{'s' if len(js) > 1 else ''} "
            f"{', '.join(map(str, js))}"
            for rank, js in self.groups(members).items()
        ]
        return f"weights: {'; '.join(parts)} over {self.backend} ({self.why})"


def send_plan(
    config: TrainerConfig,
    layout: GpuLayout | None,
    *,
    workers: int,
    one_host: bool,
    shm_bytes: int = 0,
) -> SendPlan:
    """The plan for ``workers`` rollout workers in their own processes (not the hybrid
    engine's, whose ranks each hand over in memory).

    Raises:
        RunError: ``ckpt_engine.per_rank=true`` where the rollout workers do not share the
            actor ranks' GPUs (``delta_sharded``/``in_place`` beside it are refused when the
            config loads).
    """
    cfg, world = config.ckpt_engine, config.actor.world_size
    rank0_only = [
        what
        for what, on in (
            ("ckpt_engine.delta_sharded", cfg.delta_sharded),
            ("ckpt_engine.in_place", cfg.in_place),
        )
        if on
    ]
    shared = layout is not None and all(g in layout.actors for g in layout.rollouts)
    if cfg.per_rank is None:
        per_rank = shared and not rank0_only
        why = (
            "every rollout worker shares a GPU with an actor rank: each rank sends to its own"
            if per_rank
            else "on CPUs every copy passes through host memory"
            if layout is None
            else f"rank 0 only with {rank0_only[0]}"
            if shared
            else "some rollout workers have GPUs of their own"
        )
    else:
        per_rank, why = cfg.per_rank, f"ckpt_engine.per_rank={str(cfg.per_rank).lower()}"
        if per_rank and layout is not None and not shared:
            raise RunError(
                f"ckpt_engine.per_rank=true: rollout workers on GPUs {layout.rollouts} do not "
                f"all share a GPU with an actor rank (actor ranks on {layout.actors}); set "
                "per_rank to false or null"
            )
    if not per_rank:
        backend = engine_backend(cfg.backend, layout, one_host=one_host, shm_bytes=shm_bytes)
        why += _backend_why(cfg.backend, backend, layout, one_host)
        return SendPlan((0,) * workers, backend, why)
    if layout is None:
        senders = tuple(j % world for j in range(workers))
        backend = engine_backend(cfg.backend, None, one_host=one_host, shm_bytes=shm_bytes)
    else:
        senders = tuple(layout.actors.index(g) for g in layout.rollouts)
        backend = "cuda_ipc" if cfg.backend == "auto" else cfg.backend
    why += _backend_why(cfg.backend, backend, layout, one_host)
    return SendPlan(senders, backend, why)


def _backend_why(asked: str, backend: str, layout: GpuLayout | None, one_host: bool) -> str:
    """Why the backend is what it is (the tail of the plan's log line)."""
    if asked != "auto":
        return f"; ckpt_engine.backend={asked}"
    if layout is not None:
        return {
            "cuda_ipc": "; auto: every group's members share one GPU",
            "nccl": "; auto: every member has a GPU of its own",
        }.get(backend, "; auto: members on shared and own GPUs")
    if backend == "shm":
        return "; auto: one host"
    return "; auto: several hosts" if not one_host else "; auto: /dev/shm too small"


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The actor ranks' push reports as one: the first sender's (every sender sends the
    same weights, so its bytes and digest stand for all), with the sync's seconds the
    slowest sender's and ``weight_sync_senders`` the number of ranks that sent. Ranks that
    only took part in the gathers report ``{}``."""
    sent = [r for r in reports if r]
    if not sent:
        return {}
    merged = dict(sent[0])
    if "weight_sync_s" in merged:
        merged["weight_sync_s"] = max(r["weight_sync_s"] for r in sent)
    merged["weight_sync_senders"] = len(sent)
    return merged
