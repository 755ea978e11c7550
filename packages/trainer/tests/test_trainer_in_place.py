"""``ckpt_engine.in_place``: the hf rollout engines' parameters are actor rank 0's shared
arenas, double-buffered (``rlwire.ckpt_engine``'s ``share_weights(buffers=2)``)."""

from __future__ import annotations

import pytest
from trainer_cli import train_cli

from rlwire.trainer.checks import ConfigError
from rlwire.trainer.config.root import load_config


def test_two_engines_on_one_host_hold_what_the_actor_sent_at_every_sync(ray_cluster, tmp_path):
    """Two hf rollout workers take the arena's tensors as their parameters at each commit;
    the digest of what each holds equals the actor's after every sync (three syncs: the
    arenas are written in turn, each only after both workers left it)."""
    records, _ = train_cli(
        tmp_path / "run",
        "ckpt_engine.in_place=true",
        "ckpt_engine.digest=true",
        "rollout.num_workers=2",
        "trainer.steps=3",
        cluster=ray_cluster,
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]] * 2
        assert r["weight_sync_wire_bytes"] == r["weight_sync_bytes"]  # dense: in place


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ckpt_engine.backend=gloo"], "it needs ckpt_engine.backend shm .one host., not 'gloo'"),
        (["rollout.backend=paced"], "rollout.backend is 'paced': set it to false"),
        (["ckpt_engine.delta=on"], "ckpt_engine.in_place sends dense updates"),
    ],
)
def test_in_place_is_refused_where_it_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["ckpt_engine.in_place=true", *overrides])
