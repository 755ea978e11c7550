"""``ckpt_engine.delta_sharded`` on one rank (no process group): the copies it keeps, the
changes it finds and rank 0's whole weights brought up to date with them. Two ranks end to
end: ``test_trainer_fully_async.py`` (a ``job`` test)."""

from __future__ import annotations

import torch

from rlwire.trainer.actor.fsdp import _local_shards
from rlwire.trainer.runtime.shard_deltas import ShardDeltas


def test_changes_are_exact_and_the_whole_copy_follows_them():
    torch.manual_seed(0)
    weights = {"w": torch.randn(40, 8).bfloat16(), "b": torch.randn(9), "n": torch.ones(3)}
    shards = ShardDeltas(rank=0)
    sent = []

    def collect():
        return shards.collect(
            _local_shards(weights, rank=0, world=1),
            lambda: iter(list(weights.items())),
            lambda whole: {name: value.clone() for name, value in whole},
        )

    items, changes = collect()  # the first sync: whole, and no mirror in the engine
    assert changes == dict.fromkeys(weights, None)
    sent.append(items)
    with torch.no_grad():
        weights["w"].view(torch.int16)[3, 5] ^= 1
        weights["w"].view(torch.int16)[39, 0] ^= 1
        weights["b"] += 1  # changed everywhere: whole
    items, changes = collect()
    assert changes["w"].positions.tolist() == [3 * 8 + 5, 39 * 8 + 0]
    assert changes["w"].values.dtype == torch.int16 and changes["w"].changed == 2
    assert changes["b"] is None and changes["n"].changed == 0
    for name, value in items:  # rank 0's copy is what the actor holds
        assert torch.equal(value.view(torch.uint8), weights[name].view(torch.uint8)), name


def test_local_shards_place_each_ranks_rows_as_fsdp2_splits_them():
    """FSDP2 splits dim 0 as torch.chunk: 5 rows over 2 ranks are 3 + 2; over 4, 2+2+1+0."""

    class Sharded:  # what a DTensor shows of itself here
        def __init__(self, whole: torch.Tensor, rank: int, world: int) -> None:
            self.shape, self._whole = whole.shape, whole
            self.placements = [type("Shard", (), {"dim": 0})()]
            self._part = (
                torch.chunk(whole, world)[rank]
                if rank < len(torch.chunk(whole, world))
                else whole[:0]
            )

        def dim(self) -> int:
            return self._whole.dim()

        def numel(self) -> int:
            return self._whole.numel()

        def to_local(self) -> torch.Tensor:
            return self._part

    whole = torch.arange(15.0).view(5, 3)
    for world, offsets in ((2, [0, 9]), (4, [0, 6, 12, 15])):
        for rank, offset in enumerate(offsets):
            [(name, part, at)] = list(
                _local_shards({"x": Sharded(whole, rank, world)}, rank, world)
            )
            assert (name, at) == ("x", offset)
            assert torch.equal(part.reshape(-1), whole.reshape(-1)[at : at + part.numel()])
