"""The run's plot: reward (and the validation reward) and policy loss per step, from
``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

from .summary import records

__all__ = ["plot_run"]


def plot_run(run_dir: str | Path) -> Path:
    """Render ``<run_dir>/plot.png`` from ``<run_dir>/metrics.jsonl``; return its path.

    Raises:
        FileNotFoundError: the run directory has no metrics yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist: is {run_dir} a run directory?")
    rows, held_out = records(run_dir), records(run_dir, validation=True)
    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [r["reward_mean"] for r in rows], color="tab:green", label="training")
    if held_out:
        top.plot(
            [r["step"] for r in held_out],
            [r["val/reward_mean"] for r in held_out],
            "o-",
            color="tab:purple",
            label="validation",
        )
        top.legend(loc="best")
    top.set_ylabel("reward (mean)")
    top.grid(alpha=0.3)
    bottom.plot(steps, [r["policy_loss"] for r in rows], color="tab:blue")
    bottom.set_ylabel("policy loss")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.suptitle(f"rlwire-train: {run_dir.name}")
    fig.tight_layout()
    out = run_dir / "plot.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
