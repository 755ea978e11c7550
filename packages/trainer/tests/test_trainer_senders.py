"""Who sends the weights to which rollout engine (``ckpt_engine.per_rank``,
:mod:`rlwire.trainer.runtime.senders`): the plan for GPU layouts, and on CPUs a job whose
every actor rank feeds its own engines over ``shm``."""

from __future__ import annotations

import pytest
from trainer_cli import train_cli

from rlwire.trainer.checks import ConfigError
from rlwire.trainer.config.root import load_config
from rlwire.trainer.errors import RunError
from rlwire.trainer.runtime.cluster import gpu_layout
from rlwire.trainer.runtime.senders import merge_reports, send_plan


def _plan(world, workers, gpus, mode="colocated", *overrides, one_host=True):
    config = load_config(
        overrides=[
            f"actor.world_size={world}",
            f"rollout.num_workers={workers}",
            f"trainer.mode={mode}",
            *overrides,
        ]
    )
    layout = gpu_layout(world, workers, gpus, mode)
    return send_plan(config, layout, workers=workers, one_host=one_host)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_on_a_node_of_n_gpus_every_rank_feeds_the_engines_on_its_own_gpu(world):
    """Colocated on N GPUs: N senders, each rank's group its own GPU's engines, over
    cuda_ipc (no host backend), and the log line says so."""
    plan = _plan(world, 2 * world, world)
    assert plan.senders == tuple(j % world for j in range(2 * world))
    assert len(plan.groups(list(range(2 * world)))) == world  # N senders
    assert plan.backend == "cuda_ipc"
    line = plan.describe(list(range(2 * world)))
    assert line.startswith("weights: actor rank 0 -> rollout workers 0, " + str(world))
    assert line.endswith(
        "over cuda_ipc (every rollout worker shares a GPU with an actor rank: each rank sends "
        "to its own; auto: every group's members share one GPU)"
    )


def test_the_layout_that_used_to_go_through_the_host_now_stays_on_the_device():
    """2 ranks and 2 rollout workers on 2 GPUs: rank 0 alone would reach worker 1 only
    through host gloo (``engine_backend``'s answer); per rank, each GPU's pair over IPC."""
    from rlwire.trainer.runtime.cluster import engine_backend

    assert engine_backend("auto", gpu_layout(2, 2, 2, "colocated"), one_host=True) == "gloo"
    plan = _plan(2, 2, 2, "colocated", "rollout.hybrid_engine=false")
    assert (plan.senders, plan.backend) == ((0, 1), "cuda_ipc")
    # one-step off on the actors' own GPUs too (no GPU left for a rollout pool)
    assert _plan(2, 2, 2, "one_step_off").senders == (0, 1)


@pytest.mark.parametrize(
    ("world", "workers", "gpus", "mode", "backend", "why"),
    [
        (1, 3, 4, "fully_async", "nccl", "some rollout workers have GPUs of their own"),
        (2, 2, 0, "colocated", "shm", "on CPUs every copy passes through host memory"),
    ],
)
def test_rank_0_sends_where_per_rank_has_nothing_to_gain(world, workers, gpus, mode, backend, why):
    plan = _plan(world, workers, gpus, mode, "rollout.hybrid_engine=false")
    assert plan.senders == (0,) * workers and not plan.per_rank
    assert plan.backend == backend
    assert plan.why.startswith(why)
    assert plan.groups(list(range(workers))) == {0: list(range(workers))}


def test_per_rank_on_cpus_and_its_refusals():
    plan = _plan(2, 4, 0, "colocated", "ckpt_engine.per_rank=true", "rollout.hybrid_engine=false")
    assert plan.senders == (0, 1, 0, 1) and plan.backend == "shm"
    assert plan.groups([1, 2, 3]) == {0: [2], 1: [1, 3]}  # worker 0 rejoining later
    assert plan.why == "ckpt_engine.per_rank=true; auto: one host"
    with pytest.raises(RunError, match=r"rollout workers on GPUs \[1, 2, 3\] do not all share"):
        _plan(1, 3, 4, "fully_async", "ckpt_engine.per_rank=true")
    with pytest.raises(ConfigError, match="designs around actor rank 0's one copy"):
        load_config(overrides=["ckpt_engine.per_rank=true", "ckpt_engine.in_place=true"])
    # delta_sharded keeps rank 0 under auto, with the reason
    plan = _plan(
        2,
        2,
        2,
        "colocated",
        "rollout.hybrid_engine=false",
        "ckpt_engine.delta=on",
        "ckpt_engine.delta_sharded=true",
    )
    assert plan.senders == (0, 0)
    assert plan.why.startswith("rank 0 only with ckpt_engine.delta_sharded")


def test_the_senders_reports_as_one():
    a = {"weight_sync_s": 0.5, "weight_sync_bytes": 10, "digest": "x"}
    b = {"weight_sync_s": 0.7, "weight_sync_bytes": 10, "digest": "x"}
    assert merge_reports([a, {}, b]) == {
        "weight_sync_s": 0.7,
        "weight_sync_bytes": 10,
        "digest": "x",
        "weight_sync_senders": 2,
    }
    assert merge_reports([{}, {}]) == {}


def test_two_ranks_each_feed_their_own_two_engines_over_shm(ray_cluster, tmp_path):
    """Colocated, 2 actor ranks and 4 hf rollout workers in processes of their own, every
    rank sending at once: each engine holds what the actor sent at every sync (digests),
    and each maps the shared memory of its own rank only (read from the kernel's maps of
    its process): worker j from rank j % 2."""
    run = tmp_path / "run"
    records, _ = train_cli(
        run,
        "actor.world_size=2",
        "rollout.num_workers=4",
        "rollout.hybrid_engine=false",
        "ckpt_engine.per_rank=true",
        "ckpt_engine.backend=shm",
        "ckpt_engine.digest=true",
        "trainer.steps=2",
        cluster=ray_cluster,
    )
    assert [r["step"] for r in records] == [1, 2]
    digests = set()
    for r in records:
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]] * 4
        assert r["weight_sync_senders"] == 2
        assert r["weight_sources"] == [[0], [1], [0], [1]]
        digests.add(r["weight_digest_actor"])
    assert len(digests) == 2  # the weights changed between the syncs
    log = (run / "train.log").read_text()
    assert (
        "weights: actor rank 0 -> rollout workers 0, 2; actor rank 1 -> rollout workers 1, 3 "
        "over shm (ckpt_engine.per_rank=true; ckpt_engine.backend=shm)"
    ) in log
