"""The command as a user runs it, before any cluster starts: its refusals, `--print-config`
and `plot` through its ``main`` (a run end to end: the trainer's
test_trainer_cli_run.py)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest


def _cli(*argv: str) -> tuple[int, str, str]:
    """The command's ``main`` in this process, for what ends before Ray starts: its exit code,
    stdout and stderr (a fresh interpreter costs each about 2.5 s of imports)."""
    from rlwire.trainer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


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
