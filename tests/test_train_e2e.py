"""End to end, as a user runs it: `rlwire-train` with Ray local, 2 FSDP2 actor ranks (gloo);
the command's refusals, `--print-config` and `plot` through its ``main``."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def _train(*overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rlwire.trainer.cli", "--no-progress", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _cli(*argv: str) -> tuple[int, str, str]:
    """The command's ``main`` in this process, for what ends before Ray starts: its exit code,
    stdout and stderr (a fresh interpreter costs each about 2.5 s of imports)."""
    from rlwire.trainer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_then_resume_continue_the_count_and_the_optimizer(tmp_path):
    run = tmp_path / "run"
    common = [
        f"trainer.output_dir={run}",
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
    first = _train(*common, "trainer.steps=2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    # The closing lines: what was trained, how fast, how well, and where it is.
    assert re.search(
        r"^trained 2 steps in [\d.]+ s \(training loop [\d.]+ s, \d+ samples/s\); reward "
        r"[\d.]+ \(mean of the last 10% of steps\)$",
        first.stdout,
        re.M,
    ), first.stdout
    assert f"run directory: {run}  (metrics.jsonl" in first.stdout
    records = _metrics(run)
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

    second = _train(*common, "trainer.steps=3", "trainer.max_actor_ckpt_to_keep=2")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]  # continued, not restarted
    saved = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    betas = [r["reward_extra/kl_in_reward_coef"] for r in _metrics(run)]
    assert betas[0] == 0.05 and betas[1] < 0.05  # adapted toward target_kl (kl below it)
    assert betas[2] == saved["kl_ctrl_value"]  # the resumed run went on from the saved beta
    # verl's key: the two newest complete checkpoints stay, step_1 went once step_3 was done
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert "trained 1 steps in" in second.stdout  # the summary covers this call's steps
    # The same command again: nothing to train, said in one line, before starting anything
    # (its main in this process: it ends before Ray starts).
    code, out, err = _cli("--no-progress", *common, "trainer.steps=3")
    assert code == 0 and out == (
        f"rlwire-train: {run} already holds a finished run (3 of trainer.steps=3): nothing "
        "to train. To go on, raise trainer.steps; to start a new run, choose another "
        "trainer.output_dir (or trainer.resume=never to start over here: its checkpoints are "
        "moved aside)\n"
    ), out + err[-2000:]
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3]
    # one logical state (DCP), not one file per rank; AdamW's own step count continued
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / "step_3" / "actor", tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {3.0}
    saved = json.loads((run / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert saved["step"] == 3 and saved["actor_world_size"] == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.path=/nonexistent/model", "model.path: /nonexistent/model is not a Hugging Face"),
        ("reward.function=no_such_module:f", "reward.function: cannot import"),
        ("actor.micro_batchsize=2", "did you mean 'actor.micro_batch_size'?"),
        ("ray.address=127.0.0.1:1", "ray.address: cannot reach a Ray cluster at 127.0.0.1:1"),
        # (an engine refusing its config at actor setup: test_trainer_megatron.py)
    ],
)
def test_bad_input_stops_before_training_with_one_message(override, message, tmp_path):
    code, _, err = _cli(*override.split(), f"trainer.output_dir={tmp_path / 'run'}")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("rlwire-train: error: ")
    assert message in err
    assert "Traceback" not in err


def test_print_config_and_plot_command(tmp_path):
    code, out, _ = _cli("--print-config", "actor.world_size=2")
    assert code == 0 and "world_size: 2" in out
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward_mean": 0.1, "policy_loss": 0.0}) + "\n"
    )
    code, out, _ = _cli("plot", str(tmp_path))
    assert code == 0 and (tmp_path / "plot.png").exists() and str(tmp_path) in out
