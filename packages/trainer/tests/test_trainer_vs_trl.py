"""The default job under TRL's GRPOTrainer (``rlwire.trainer.tools.vs_trl``, what the bench's
``--vs trl`` runs), in the environment ``.ci/trl`` builds: it runs, learns the task's format
and reports what the comparison reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.trl


def test_the_matched_trl_job_runs_and_reports_loop_time_and_rewards(tmp_path):
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
        "4",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["steps"] == 4 and len(report["rewards"]) == 4
    assert all(0.0 <= r <= 1.0 for r in report["rewards"])
    assert report["loop_s"] > 0
    assert report["samples_per_s"] == pytest.approx(4 * 64 / report["loop_s"])
    assert report["trl"] == "1.16.0"
