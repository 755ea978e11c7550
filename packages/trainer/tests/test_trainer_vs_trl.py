"""The default job under TRL's GRPOTrainer (``rlwire.trainer.tools.vs_trl``, what the bench's
``--vs trl`` runs), in the environment ``.ci/trl`` builds: it runs, learns the task (its
last steps' reward well above its first steps') and reports what the comparison reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.trl

STEPS = 60
"""Enough for the default job to learn under TRL: 7-16 s of loop on 2 busy cores."""
WINDOW = 10
"""Steps averaged at each end of the run."""
MARGIN = 0.15
"""How much the last steps' mean reward must exceed the first steps'. Measured with TRL
1.16, torch 2.13 and one thread on the default tiny model, 60 steps, seeds 0-4: the first 10
steps' mean 0.063-0.068 (about what random letters score), the last 10's 0.38-0.69, so the
rise was 0.32-0.62; a run that does not learn rises by about 0."""


def test_the_matched_trl_job_learns_the_task_and_reports_loop_time_and_rewards(tmp_path):
    from rlwire.trainer.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    out = tmp_path / "trl.json"
    cmd = [
        sys.executable,
        "-m",
        "rlwire.trainer.tools.vs_trl",
        str(model),
        str(out),
        "--steps",
        str(STEPS),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    rewards = report["rewards"]
    assert report["steps"] == STEPS and len(rewards) == STEPS
    assert all(0.0 <= r <= 1.0 for r in rewards)
    # It learns: the mean reward of the last steps (each step's mean over its 64 samples)
    # well above that of the first ones.
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    rise = sum(last) / WINDOW - sum(first) / WINDOW
    assert rise > MARGIN, f"the reward rose by {rise:.3f} ({MARGIN} asked): {rewards}"
    assert report["loop_s"] > 0
    assert report["samples_per_s"] == pytest.approx(STEPS * 64 / report["loop_s"])
    assert len(report["step_s"]) == STEPS and all(s > 0 for s in report["step_s"])
    assert report["trl"] == "1.16.0"
