"""Actor strategies and dtypes end to end: FSDP1 = FSDP2 on 2 gloo ranks (balanced or not);
bfloat16 weights; hybrid engines = rollout workers; two nodes."""

from __future__ import annotations

import pytest
import torch
from trainer_cli import FSDP2_REFERENCE, train_cli  # this folder: pytest puts it on sys.path


@pytest.mark.floor
def test_fsdp1_on_balanced_ranks_agrees_with_fsdp2_on_the_first_step_and_its_gradient_norm(
    fsdp2_reference, ray_cluster, tmp_path
):
    """FSDP1 against the FSDP2 reference, one run for two claims: the strategies agree, and
    ``trainer.balance_batch`` (verl's key), which gives the 2 ranks rows of near-equal tokens
    instead of consecutive halves (the reference's), trains the same batch: the same loss and
    gradient over the ranks, up to the order of floating-point sums. (The partition itself:
    test_trainer_dynamic_bsz.py.)"""
    fsdp2 = fsdp2_reference
    fsdp1, _ = train_cli(
        tmp_path / "fsdp1",
        *FSDP2_REFERENCE,
        "trainer.steps=1",
        "actor.strategy=fsdp",
        "trainer.balance_batch=true",
        cluster=ray_cluster,
    )
    assert fsdp1[0]["reward_mean"] == fsdp2[0]["reward_mean"]  # the same samples
    assert fsdp1[0]["policy_loss"] == pytest.approx(fsdp2[0]["policy_loss"], abs=1e-6)
    # The norm of the whole gradient, not of one rank's shard (FSDP1 clips collectively).
    assert fsdp1[0]["grad_norm"] == pytest.approx(fsdp2[0]["grad_norm"], rel=1e-5)


def test_a_bfloat16_actor_updates_its_bfloat16_rollout_copy_by_deltas(ray_cluster, tmp_path):
    """On CPUs on one host ``ckpt_engine.backend=auto`` is ``shm`` with its zero-copy path:
    the weights go through the shared arena laid out on the first sync. With ``delta=on``
    every sync after the first sends only the bf16 elements the step changed (the actor keeps
    float32 master weights: each sync casts them, and the export writes them)."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "bf16"
    records, _ = train_cli(
        run,
        "model.dtype=bfloat16",
        "trainer.steps=3",
        "actor.optim.lr=1e-4",
        "ckpt_engine.digest=true",
        "ckpt_engine.delta=on",
        cluster=ray_cluster,
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # the hf rollout copy holds exactly the weights sent, in bfloat16
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]]
        assert 0 < r["weight_sync_delta_density"] < 1, r
        assert r["weight_sync_wire_bytes"] < r["weight_sync_bytes"], r
    assert len({r["weight_digest_actor"] for r in records}) == 3
    assert "checkpoint engine: shm" in (run / "train.log").read_text()
    model = AutoModelForCausalLM.from_pretrained(run / "hf_model", dtype="auto")
    assert next(model.parameters()).dtype == torch.float32  # the master weights, as TRL saves
    state = model.state_dict()  # every tensor sent once, in bfloat16
    assert records[0]["weight_sync_bytes"] == sum(t.numel() * 2 for t in state.values())


def test_hybrid_engines_in_two_fsdp2_ranks_train_exactly_as_separate_rollout_workers(
    fsdp2_reference_run, fsdp2_reference, ray_cluster, tmp_path
):
    """Two FSDP2 ranks, two rollout engines: inside the ranks' processes (hybrid, weights
    handed over in memory: the reference run) or in processes of their own (the
    shared-memory engine) give the same samples, losses, gradients and weights, and every
    engine holds the actor's."""
    run = tmp_path / "separate"
    separate, _ = train_cli(
        run, *FSDP2_REFERENCE, "trainer.steps=3", "rollout.hybrid_engine=false", cluster=ray_cluster
    )
    runs = {"true": (fsdp2_reference_run, fsdp2_reference), "false": (run, separate)}
    for hybrid, (directory, records) in runs.items():
        for r in records:
            assert r["weight_digest_rollout"] == [r["weight_digest_actor"]] * 2, r
        log = (directory / "train.log").read_text()
        assert ("checkpoint engine: naive" in log) == (hybrid == "true")
    for a, b in zip(fsdp2_reference, separate, strict=True):
        for key in ("reward_mean", "policy_loss", "grad_norm", "weight_digest_actor"):
            assert a[key] == b[key], key
    assert len({r["weight_digest_actor"] for r in fsdp2_reference}) == 3  # the weights moved


@pytest.mark.job  # a cluster of its own
def test_two_nodes_place_ranks_on_their_gpus_and_nodes_at_node_addresses(tmp_path):
    """Two simulated nodes (``ray.cluster_utils.Cluster``) with one logical GPU each: the
    processes compute on the CPU here, but the placement is Ray's own, asked for as on GPUs."""
    import ast
    import re

    from ray.cluster_utils import Cluster

    from rlwire.trainer.runtime.cluster import ray_environment

    ray_environment()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
    try:
        cluster.add_node(num_cpus=2, num_gpus=1)
        cluster.wait_for_nodes()
        train_cli(
            tmp_path / "gpus",
            "actor.world_size=2",
            "rollout.num_workers=2",
            "ckpt_engine.backend=gloo",
            "trainer.steps=1",
            cluster=cluster.address,
        )
        node_ips = {node.node_ip_address for node in cluster.list_all_nodes()}
    finally:
        cluster.shutdown()
    log = (tmp_path / "gpus" / "train.log").read_text()
    found = re.search(
        r"GPUs: actor ranks on bundles \[0, 1\] \(Ray GPU ids (\[.*?\]\])\), "
        r"rollout workers on \[0, 1\] \((\[.*?\]\])\)",
        log,
    )
    assert found, log[-2000:]
    actors, rollouts = ast.literal_eval(found[1]), ast.literal_eval(found[2])
    assert len(actors) == 2 and all(len(ids) == 1 for ids in actors)
    assert rollouts == actors  # rollout worker i shares actor rank i's GPU (colocated)
    # One bundle (a whole GPU) per node: the ranks on different nodes, each rollout
    # worker on its actor rank's node.
    nodes = re.search(r"nodes: actor ranks on (\[.*?\]), rollout workers on (\[.*?\])", log)
    assert nodes, log[-2000:]
    actor_nodes, rollout_nodes = ast.literal_eval(nodes[1]), ast.literal_eval(nodes[2])
    assert len(set(actor_nodes)) == 2 and rollout_nodes == actor_nodes
    # Several nodes: every address handed out is the node's, never loopback.
    store = re.search(r"actor group store at ([\d.]+):\d+", log)
    engine = re.search(r"checkpoint engine master at ([\d.]+):\d+", log)
    assert store and engine, log[-2000:]
    assert store[1] in node_ips and engine[1] in node_ips and "127.0.0.1" not in node_ips
