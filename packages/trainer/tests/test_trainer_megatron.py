"""The Megatron actor engine (``actor.strategy=megatron``) on CPU with gloo: the DDP config and
gradient buffers it builds, two training steps with 2 ranks, weights reaching the rollout
worker, the same first-step loss as FSDP2, and a resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reshard import assert_resharded, run_script, save_or_load
from trainer_cli import FSDP2_REFERENCE, checkpoint_state, train_cli

from rlwire.trainer.config.root import ConfigError, load_config


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron") / "engines.json"
    run_script(2, "trainer_megatron_worker.py", str(out))
    data = json.loads(out.read_text())
    assert data["world_size"] == 2
    return {r["case"]: r for r in data["results"]}


@pytest.mark.parametrize(
    ("case", "reduce_in_fp32", "buffer"),
    [
        # the four precision combinations: fp32 reduction unless the optimizer is
        # precision-aware with bf16 main grads (rlwire.megatron_ddp's rule)
        ("fp32_main_grads", True, "torch.float32"),
        ("bf16_main_grads_without_precision_aware", True, "torch.float32"),
        ("precision_aware_fp32", True, "torch.float32"),
        ("precision_aware_bf16", False, "torch.bfloat16"),
        # explicit overrides win
        ("explicit_bf16_reduce", False, "torch.bfloat16"),
        ("explicit_fp32_reduce_precision_aware_bf16", True, "torch.float32"),
    ],
)
def test_engine_resolves_the_ddp_gradient_dtype(engines, case, reduce_in_fp32, buffer):
    r = engines[case]
    assert (
        r["ddp_type"] == "megatron.core.distributed.distributed_data_parallel_config."
        "DistributedDataParallelConfig"
    )
    assert r["ddp"]["grad_reduce_in_fp32"] == repr(reduce_in_fp32)
    assert r["ddp"]["use_distributed_optimizer"] == "True"  # the engine's default
    assert r["buffers"] == [buffer]  # bf16 parameters: the buffer dtype shows the choice
    assert r["main_grad_is_buffer_view"]
    if case.startswith("explicit"):  # an override against the optimizer's precision is flagged
        assert r["warnings"] and all("grad_reduce_in_fp32" in w for w in r["warnings"])


def test_engine_builds_megatrons_optimizers(engines):
    dist_opt = engines["engine_distributed_optimizer"]
    assert dist_opt["optimizer"] == "ChainedOptimizer"
    assert dist_opt["inner"] == ["DistributedOptimizer"]
    assert dist_opt["buffers"] == ["torch.float32"]
    plain = engines["engine_plain_optimizer"]
    assert plain["inner"] == ["Float16OptimizerWithFloat16Params"]  # bf16 params, fp32 main
    assert plain["ddp"]["use_distributed_optimizer"] == "False"
    failed = engines["engine_precision_aware_on_cpu"]
    assert failed["error"].startswith(
        "actor.megatron: Megatron-Core rejects this optimizer configuration (the "
        "precision-aware optimizer needs Transformer Engine's FusedAdam: CUDA)"
    )


def test_tensor_and_pipeline_parallelism_are_refused():
    with pytest.raises(
        ConfigError,
        match=r"^actor\.megatron\.tensor_model_parallel_size: 2 is "
        r"not allowed; the Megatron engine is data parallel only",
    ):
        load_config(
            overrides=["actor.strategy=megatron", "actor.megatron.tensor_model_parallel_size=2"]
        )
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size: 4 is not allowed"):
        load_config(overrides=["actor.megatron.pipeline_model_parallel_size=4"])


def _train(run: Path, cluster: str, *overrides: str) -> tuple[list[dict], str]:
    return train_cli(run, *FSDP2_REFERENCE, "actor.strategy=megatron", *overrides, cluster=cluster)


# Same seed, data and initial weights: the first step's rollout is identical, so the loss
# (computed before any update) agrees to float rounding; the gradient norm after the
# (differently ordered) reductions to a relative 1e-5.
LOSS_TOLERANCE = 1e-6


@pytest.mark.floor
def test_two_megatron_steps_match_fsdp2_reach_the_rollout_and_resume(
    fsdp2_reference, ray_cluster, tmp_path
):
    fsdp2 = fsdp2_reference
    megatron, stderr = _train(
        tmp_path / "megatron",
        ray_cluster,
        "trainer.steps=2",
        # fp32 parameters: the same buffer either way, but the consistency check speaks up
        "actor.megatron.override_ddp_config.grad_reduce_in_fp32=false",
    )
    warnings = [x for x in stderr.splitlines() if x.startswith("rlwire-train: warning: megatron:")]
    assert len(warnings) == 1 and "grad_reduce_in_fp32=False" in warnings[0]
    assert [r["step"] for r in megatron] == [1, 2]
    for r in megatron:
        assert torch.isfinite(torch.tensor(r["policy_loss"])) and r["grad_norm"] > 0
        # each rank's rollout engine (hybrid) holds exactly the weights Megatron's engine
        # exported
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]] * 2
    assert megatron[0]["weight_digest_actor"] != megatron[1]["weight_digest_actor"]
    assert megatron[0]["reward_mean"] == fsdp2[0]["reward_mean"]  # the same samples
    assert abs(megatron[0]["policy_loss"] - fsdp2[0]["policy_loss"]) <= LOSS_TOLERANCE
    assert megatron[0]["grad_norm"] == pytest.approx(fsdp2[0]["grad_norm"], rel=1e-5)

    # resume on one rank: the step count, weights and Megatron's distributed optimizer state
    # (saved as full per-parameter states) carry on at another data-parallel size
    resumed, stderr = _train(
        tmp_path / "megatron",
        ray_cluster,
        "trainer.steps=3",
        "actor.world_size=1",
        "rollout.num_workers=1",  # hybrid again: one rank, one engine in its process
    )
    assert "warning: megatron" not in stderr
    assert [r["step"] for r in resumed] == [1, 2, 3]
    log = (tmp_path / "megatron" / "train.log").read_text()
    assert "resumed at actor.world_size=1 from a checkpoint saved at 2" in log
    state = checkpoint_state(tmp_path / "megatron" / "checkpoints" / "step_3")
    assert float(state["optimizer"]["step"]) == 3.0  # Adam's own step count continued


def test_megatron_checkpoint_saved_on_two_ranks_loads_on_one(tmp_path):
    save_or_load(2, "save", tmp_path, "megatron")
    save_or_load(1, "load", tmp_path, "megatron")
    assert_resharded(tmp_path, "megatron", 2, 1)


def test_an_engine_refusing_its_config_at_setup_stops_the_run_with_one_line(ray_cluster, tmp_path):
    # Found only inside an actor rank, by Megatron-Core itself: the run still ends with one
    # error line and exit code 2, no traceback.
    cmd = [
        sys.executable,
        "-m",
        "rlwire.trainer.cli",
        "--no-progress",
        f"trainer.output_dir={tmp_path / 'run'}",
        f"ray.address={ray_cluster}",
        "actor.strategy=megatron",
        "actor.megatron.optimizer.use_precision_aware_optimizer=true",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("rlwire-train: error: ")
    assert (
        "actor setup failed: actor.megatron: Megatron-Core rejects this optimizer "
        "configuration (the precision-aware optimizer needs Transformer Engine"
    ) in result.stderr
    assert "Traceback" not in result.stderr
