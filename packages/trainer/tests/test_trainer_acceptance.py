"""``python -m rlwire.trainer.tools.acceptance``: the device check's table of finished runs."""

from __future__ import annotations

import json

import pytest

from rlwire.trainer.tools.acceptance import main, summary


def _run(path, rewards, sync=0.1):
    path.mkdir()
    lines = [
        {
            "step": i + 1,
            "reward_mean": r,
            "time_rollout_s": 1.0,
            "time_update_s": 0.9,
            "time_weight_sync_s": 1.0 if i == 0 else sync,  # the first sync lays buffers out
            **({"weight_sync_senders": 2} if i == 0 else {}),
        }
        for i, r in enumerate(rewards)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_the_figures_of_a_run(tmp_path):
    got = summary(_run(tmp_path / "a", [0.0] * 5 + [0.5] * 5))
    assert (got["steps"], got["reward_first"], got["reward_last"], got["rose"]) == (
        10,
        0.0,
        0.5,
        "yes",
    )
    assert got["sync_share"] == pytest.approx(1.9 / (10 * 1.9 + 1.9))  # 1 + 9 x 0.1 of 10 steps
    assert got["sync_share_after_first"] == pytest.approx(0.1 / 2.0)
    assert got["senders"] == 2


def test_a_run_that_did_not_learn_or_did_not_train_fails_when_asked(tmp_path, capsys):
    flat = _run(tmp_path / "flat", [0.3] * 4)
    assert main([str(flat)]) == 0  # the table alone
    assert main([str(flat), str(tmp_path / "none"), "--require-rise"]) == 1
    err = capsys.readouterr().err
    assert "FAIL: flat: the reward did not rise" in err
    assert f"FAIL: {tmp_path / 'none'}: no metrics.jsonl lines" in err
