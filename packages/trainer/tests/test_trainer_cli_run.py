"""``rlwire-train`` end to end as a user runs it, on the tests' cluster: two steps on two FSDP2
ranks, then the same command resumed to a third (a job: CI's step 1b)."""

from __future__ import annotations

import dataclasses
import json
import re

import torch
from trainer_cli import metrics, run_cli, train_cli

from rlwire.trainer.outputs.metric_names import ALIASES
from rlwire.trainer.outputs.metrics import StepMetrics

# The schema both modes write (rlwire.trainer.outputs.metrics.StepMetrics): a colocated run without
# digests writes exactly its required fields (``tokens`` only feeds the rates).
# Always written; then optional ones (None is left out); reward_extra goes out flattened.
METRIC_KEYS = {
    f.name for f in dataclasses.fields(StepMetrics) if f.default is dataclasses.MISSING
} - {"tokens", "reward_extra"}
OPTIONAL_KEYS = {
    f.name for f in dataclasses.fields(StepMetrics) if f.default is not dataclasses.MISSING
}


def test_two_steps_then_resume_continue_the_count_and_the_optimizer(ray_cluster, tmp_path):
    """The command as a user runs it, twice on one run directory: its closing lines, every
    metric's name (ours and the aliases verl and TRL use), the KL to a frozen reference and
    an adaptive KL coefficient carried across the resume, offload between phases, verl's
    checkpoint retention, and the same command once more finding the run finished."""
    run = tmp_path / "run"
    common = [
        "actor.world_size=2",
        "trainer.save_every=1",
        "algorithm.kl_coef=0.1",  # with a frozen reference policy (the initial weights)
        # and the KL in the reward, its beta adapted (and checkpointed)
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.horizon=1000",
        # Offload between phases: without an accelerator the same calls, moving nothing.
        "actor.offload=true",
        "actor.micro_batch_size=8",  # 4 micro-batches per rank: gradients held between them
    ]
    _, first = train_cli(run, *common, "trainer.steps=2", cluster=ray_cluster)
    # The closing lines: what was trained, how fast, how well, and where it is.
    assert re.search(
        r"^trained 2 steps in [\d.]+ s \(training loop [\d.]+ s, \d+ samples/s\); reward "
        r"[\d.]+ \(mean of the last 10% of steps\)$",
        first,
        re.M,
    ), first
    assert f"run directory: {run}  (metrics.jsonl" in first
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the reward's, ours, and verl's and TRL's names for some of ours (the same values)
        aliased = {name: ours for ours, names in ALIASES.items() for name in names}
        assert all(r[name] == r[ours] for name, ours in aliased.items() if name in r)
        fields = {k for k in r if not k.startswith(("reward_extra/", "rewards/"))} - set(aliased)
        assert METRIC_KEYS <= fields <= METRIC_KEYS | OPTIONAL_KEYS
        assert r["weight_sync_bytes"] > 0  # colocated: a sync after every step
        assert r["grad_sync_policy"] == "defer" and r["retained_grad_bytes"] > 0
        assert 0.0 <= r["reward_mean"] <= 1.0
    # step 1 trains the initial weights: KL to the reference is 0; after an update it is not
    assert records[0]["kl_ref"] < 1e-7 and records[1]["kl_ref"] > 1e-6
    assert (run / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "config.yaml").exists() and (run / "train.log").exists()
    assert (run / "checkpoints" / "step_2" / "COMPLETE").exists()

    _, second = train_cli(
        run, *common, "trainer.steps=3", "trainer.max_actor_ckpt_to_keep=2", cluster=ray_cluster
    )
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]  # continued, not restarted
    saved = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    betas = [r["reward_extra/kl_in_reward_coef"] for r in metrics(run)]
    assert betas[0] == 0.05 and betas[1] < 0.05  # adapted toward target_kl (kl below it)
    assert betas[2] == saved["kl_ctrl_value"]  # the resumed run went on from the saved beta
    # verl's key: the two newest complete checkpoints stay, step_1 went once step_3 was done
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert "trained 1 steps in" in second  # the summary covers this call's steps
    # The same command again: nothing to train, said in one line, before starting anything
    # (its main in this process: it ends before Ray starts).
    code, out = run_cli(run, *common, "trainer.steps=3", cluster=ray_cluster)
    assert (
        code == 0
        and (
            f"rlwire-train: {run} already holds a finished run (3 of trainer.steps=3): nothing "
            "to train. To go on, raise trainer.steps; to start a new run, choose another "
            "trainer.output_dir (or trainer.resume=never to start over here: its checkpoints are "
            "moved aside)\n"
        )
        in out
    ), out[-2000:]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    # one logical state (DCP), not one file per rank; AdamW's own step count continued
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / "step_3" / "actor", tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {3.0}
    saved = json.loads((run / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert saved["step"] == 3 and saved["actor_world_size"] == 2
