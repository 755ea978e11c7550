"""verl's and TRL's metric names beside ours, and where a wandb run logs."""

from __future__ import annotations

from pathlib import Path

from rlwire.trainer.outputs.loggers import wandb_mode
from rlwire.trainer.outputs.metric_names import ALIASES, with_aliases


def test_shared_metrics_are_also_under_verls_and_trls_names():
    line = {"step": 3, "reward_mean": 0.5, "kl_ref": 0.01, "reward_extra/letter": 0.25}
    named = with_aliases(line)
    assert named == {
        **line,
        "critic/score/mean": 0.5,
        "reward": 0.5,
        "actor/kl_loss": 0.01,
        "kl": 0.01,
        "rewards/letter/mean": 0.25,
    }
    assert with_aliases({"reward_mean": 1.0, "reward": 2.0})["reward"] == 2.0  # never replaced
    page = (Path(__file__).resolve().parents[3] / "docs/reference/metric-names.md").read_text()
    for ours, theirs in ALIASES.items():  # the docs' table lists every mapping
        assert all(f"`{name}`" in page for name in theirs) and f"`{ours}`" in page, ours


def test_wandb_is_online_with_the_users_login_and_says_when_offline(tmp_path):
    run = tmp_path / "run"
    assert wandb_mode({"WANDB_MODE": "disabled"}, run) == ("disabled", None)
    assert wandb_mode({"WANDB_API_KEY": "k"}, run) == ("online", None)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc.chmod(0o600)
    assert wandb_mode({"NETRC": str(netrc)}, run) == ("online", None)  # as `wandb login` left it
    assert wandb_mode({"HOME": str(tmp_path)}, run)[0] == "offline"  # no ~/.netrc there
    mode, line = wandb_mode({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.corp"}, run)
    assert mode == "offline" and line == (
        f"trainer.logger=wandb: no wandb login (wandb.corp in {netrc}, or WANDB_API_KEY): "
        f"logging offline to {run / 'wandb'}; upload it with `wandb sync`, or run `wandb login` "
        "first"
    )
