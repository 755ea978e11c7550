"""One-step off-policy mode: exactly one version of lag, and deterministic for a seed."""

from __future__ import annotations

import pytest
from trainer_cli import train_cli

from rlwire.trainer.config.root import load_config

_TIMING = ("time_", "_per_s", "_gbps", "rollout_paused_s", "rollout_commit_s", "wait_for_samples_s")


def test_verls_recipe_name_is_accepted_and_hybrid_engine_refused():
    from rlwire.trainer.config.root import ConfigError

    config = load_config(overrides=["trainer.mode=one_step_off_policy"])
    assert config.trainer.mode == "one_step_off" and config.trainer.off_policy
    assert not config.hybrid_engine()  # generation overlaps the update: a process of its own
    assert not config.reuses_training_logprobs()  # the proximal forward is needed
    assert config.algorithm.rollout_correction.is_level(config.trainer.off_policy) == "token"
    with pytest.raises(ConfigError, match=r"trainer.mode='one_step_off' \(colocated only\)"):
        load_config(overrides=["trainer.mode=one_step_off", "rollout.hybrid_engine=true"])
    with pytest.raises(ConfigError, match=r"^trainer.mode: 'one_step' .*use 'colocated', "):
        load_config(overrides=["trainer.mode=one_step"])


def test_one_version_stale_and_deterministic(ray_cluster, tmp_path):
    """Two runs with one seed and 2 rollout workers give the same metrics; the first batch
    is on-policy and every later one exactly one version old (as the workers stamped its
    tokens); every sync reaches both workers intact. In the second, rollout worker 1 dies
    (SIGKILL, :mod:`dying_rollout`) in its second generation: the run heals (its share
    generated again by worker 0, a replacement joining at the next sync) and trains the
    same weights."""
    settings = (
        "trainer.mode=one_step_off",
        "rollout.num_workers=2",
        "trainer.steps=4",
        "ckpt_engine.digest=true",
        "trainer.seed=3",
    )
    first, _ = train_cli(tmp_path / "a", *settings, cluster=ray_cluster)
    # the second validates too (verl's keys; greedy, held-out prompts): it must not change
    # a single training metric
    validation = (
        "data.val_files=builtin:repeat",
        "trainer.test_freq=2",
        "trainer.val_before_train=true",
        "actor_rollout_ref.rollout.val_kwargs.n=1",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
    )
    dies = "rollout.backend=dying_rollout:DiesOnceThenValidating"
    lines, out = train_cli(tmp_path / "b", *settings, *validation, dies, cluster=ray_cluster)
    assert (tmp_path / "b" / "rollout-died").exists()  # it did die
    assert "rollout worker 1 died; starting its replacement (restart 1 of 3" in out
    assert "(batch 1, prompts 4-7) are generated again by rollout worker 0" in out
    # and worker 0 in its second validation: its held-out share validated by worker 1
    assert (tmp_path / "b" / "rollout-died-validating").exists()
    assert "rollout worker 0 was validating are validated again by rollout worker 1" in out
    second = [r for r in lines if "reward_mean" in r]
    held_out = [r for r in lines if "reward_mean" not in r]
    assert [r["step"] for r in held_out] == [0, 2, 4]  # before, every 2nd, and the last
    for r in held_out:
        assert 0.0 <= r["val/reward_mean"] <= 1.0 and r["val/response_length"] > 0
        assert r["val/builtin:repeat/reward_mean"] == r["val/reward_mean"]
    assert held_out[0]["val/reward_mean"] != held_out[2]["val/reward_mean"]  # trained
    assert [r["version_lag_max"] for r in first] == [0, 1, 1, 1]
    assert [r["version_lag_mean"] for r in first] == [0.0, 1.0, 1.0, 1.0]
    assert [r["weight_version"] for r in first] == [1, 2, 3, 3]  # no sync after the last
    # the staleness-aware step size: lr / (1 + lag) once a response moved > 0.1 nats
    for r in first:
        moved = r["kl_behaviour_proximal"] * r["response_length"]
        assert r["lr_scale"] == (0.5 if r["version_lag_mean"] and moved > 0.1 else 1.0)
    assert 0.5 in [r["lr_scale"] for r in first]  # it acted (this job's large steps)
    for r in first[:3]:
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]] * 2
    assert "weight_digest_actor" not in first[3]
    assert len({r["weight_digest_actor"] for r in first[:3]}) == 3  # the weights moved
    assert first[0]["kl_behaviour_proximal"] < 1e-6  # on-policy: only numerics differ
    assert all(r["kl_behaviour_proximal"] > 1e-4 for r in first[1:])  # one update apart

    assert [r["rollout_restarts"] for r in first] == [0] * 4
    # worker 1 in the first step (batch 1), worker 0 in step 2's validation
    assert [r["rollout_restarts"] for r in second] == [1, 1, 2, 2]
    assert [r.get("regenerated_groups") for r in second] == [4, None, None, None]
    assert [r["rollout_engines_live"] for r in first + second] == [2] * 8
    # (and the re-formed weight group's first update is whole: another delta density)
    healing = ("rollout_restarts", "regenerated_groups", "weight_sync_delta_density")

    def untimed(rows):
        return [
            {k: v for k, v in r.items() if not any(t in k for t in (*_TIMING, *healing))}
            for r in rows
        ]

    assert untimed(first) == untimed(second)  # the weights' digests among them


def test_a_worker_that_loses_its_server_is_left_out_until_it_answers(ray_cluster, tmp_path):
    """Rollout worker 1 loses its engine in its second generation (its server stopped
    answering: :class:`~rlwire.trainer.rollout.EngineLost`, :mod:`dying_rollout`) and its
    "server" answers again 2 s later. Its share is generated by worker 0; the syncs go on
    without it (``rollout_engines_live`` 1, one receiver) until its replacement loaded,
    which then joins the re-formed group, gets the current weights whole and generates
    again. Every worker holds what the actor sent, and the run trains exactly the weights
    of a run without the loss."""
    settings = (
        "trainer.mode=one_step_off",
        "rollout.num_workers=2",
        "trainer.steps=12",
        "ckpt_engine.digest=true",
        "rollout.paced_step_s=0.3",  # generation slow enough to see the replacement join
    )
    plain, _ = train_cli(tmp_path / "a", *settings, "rollout.backend=paced", cluster=ray_cluster)
    lost = "rollout.backend=dying_rollout:LosesServerOnce"
    records, out = train_cli(tmp_path / "b", *settings, lost, cluster=ray_cluster)
    assert "rollout worker 1 lost its engine; starting its replacement (restart 1 of 3" in out
    assert "(batch 1, prompts 4-7) are generated again by rollout worker 0" in out
    live = [r["rollout_engines_live"] for r in records]
    back = live.index(2)  # left out, then back for good
    assert back > 0 and set(live[:back]) == {1} and set(live[back:]) == {2}, live
    for r in records[:-1]:  # every sync: each member holds the actor's weights
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]] * r["rollout_engines_live"]
    assert [r["weight_digest_actor"] for r in records[:-1]] == [
        r["weight_digest_actor"] for r in plain[:-1]
    ]  # the same training, step for step


def test_staleness_aware_step_size_rule():
    from rlwire.trainer.config.sections import OptimConfig

    always, gated, never = (OptimConfig(stale_lr_kl=v) for v in (0.0, 1e-2, None))
    assert always.lr_scale(0.0, 0.5) == 1.0  # on-policy: never acts
    assert always.lr_scale(1.0, 1e-9) == 0.5 and always.lr_scale(3.0, 1e-6) == 0.25
    assert gated.lr_scale(1.0, 1e-2) == 1.0 and gated.lr_scale(2.0, 0.02) == 1 / 3
    assert never.lr_scale(5.0, 9.0) == 1.0
    with pytest.raises(ValueError, match=r"stale_lr_kl: -1.0 .*use a float >= 0, or null"):
        OptimConfig(stale_lr_kl=-1.0)
