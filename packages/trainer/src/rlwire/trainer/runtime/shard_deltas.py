"""Each actor rank diffs its own shard before anything is gathered (``ckpt_engine.
delta_sharded``, verl's ``delta_sharded``): a sync then gathers only the changed elements to
rank 0, not the whole model, and the comparison is divided over the ranks.

Every rank keeps a copy of its shards as last sent; rank 0 keeps the whole weights as last
sent (its copy: the ``shm`` arena with a zero-copy backend), brings them up to date with the
changes it gathers, sends them whole when the update goes dense and the changes
(``send_weights(changes=)``) when it goes as a delta. The first sync gathers whole tensors
once, to lay these copies out. Used by :class:`~.weight_push.WeightPush`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["ShardDeltas"]

Piece = tuple[str, int, Any, Any]
"""``(name, offset, positions or None, values or the whole shard)`` from one rank."""


class ShardDeltas:
    """One actor rank's copies of what the last sync sent (see the module)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.shards: dict[str, torch.Tensor] = {}
        """This rank's shards as last sent."""
        self.whole: dict[str, torch.Tensor] | None = None
        """Rank 0: the whole weights as last sent."""

    def collect(
        self,
        shards: Iterable[tuple[str, torch.Tensor, int]],
        gathered: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        keep: Callable[[Iterable[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]],
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any] | None]:
        """This sync's ``(weights, changes)`` on rank 0 (``([], None)`` on the others, which
        take part in the collectives). ``shards``: the actor's
        :meth:`~rlwire.trainer.actor.ActorEngine.local_shards`; ``gathered``: the whole
        weights (a collective, the first sync only); ``keep``: rank 0's place for the whole
        weights (the arena, or a copy), given them once. ``changes`` is None on the first
        sync (nothing sent before: every tensor whole)."""
        from rlwire.ckpt_engine import Delta, diff

        shards = list(shards)
        if not self.shards:  # the first sync: whole tensors, and the copies laid out
            whole = gathered()
            self.shards = {name: part.contiguous().clone() for name, part, _ in shards}
            if self.rank == 0:
                self.whole = keep(whole)
            else:  # the gathers are collectives every rank takes part in: to the end
                collections.deque(whole, maxlen=0)
            if self.whole is None:
                return [], None
            # whole this time, and no mirror in the engine either
            return list(self.whole.items()), dict.fromkeys(self.whole, None)
        pieces: list[Piece] = []
        for name, part, offset in shards:
            part = part.contiguous()
            found = diff(self.shards[name], part)
            if found is None:  # mostly changed: the whole shard (diff copied it in)
                pieces.append((name, offset, None, part.clone()))
            else:
                pieces.append((name, offset, found.positions, found.values))
        every = _gather(pieces, self.rank)
        if self.rank != 0:
            return [], None
        assert self.whole is not None  # laid out by the first sync
        changes: dict[str, Any] = {}
        by_rank = [dict((p[0], p) for p in ranks) for ranks in every]
        for name, target in self.whole.items():
            flat = target.view(-1)
            positions, values, whole_part = [], [], False
            for ranks in by_rank:
                _, offset, at, data = ranks[name]
                if at is None:  # a whole shard
                    flat[offset : offset + data.numel()].copy_(data.reshape(-1))
                    whole_part = True
                    continue
                at = at.to(flat.device) + offset
                flat.view(data.dtype).index_copy_(0, at, data.to(flat.device))  # words
                positions.append(at)
                values.append(data)
            changes[name] = (
                None
                if whole_part
                else Delta(
                    tuple(target.shape), target.dtype, torch.cat(positions), torch.cat(values)
                )
            )
        return list(self.whole.items()), changes


def _gather(pieces: list[Piece], rank: int) -> list[list[Piece]]:
    """Every rank's pieces on rank 0 (one ``gather_object`` per sync: the changes only)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [pieces]
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(pieces, out, dst=0)
    return out if out is not None else []
