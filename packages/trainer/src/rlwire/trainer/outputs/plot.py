"""The run's plot: reward (and the validation reward) and policy loss per step, from
``metrics.jsonl``; with multi-turn rollouts also the turns, tool calls and tool errors per
trajectory and the tool time per call. And the modes benchmark's plot: each run's reward
over training-loop time, per seed."""

from __future__ import annotations

from pathlib import Path

from .summary import WINDOW, records, reward_curve

__all__ = ["plot_modes", "plot_run"]


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
    agent = bool(rows) and "turns_mean" in rows[0]
    fig, axes = plt.subplots(3 if agent else 2, 1, figsize=(7, 9 if agent else 6), sharex=True)
    top, bottom = axes[0], axes[1]
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
    bottom.grid(alpha=0.3)
    if agent:
        _agent_panel(axes[2], steps, rows)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"rlwire-train: {run_dir.name}")
    fig.tight_layout()
    out = run_dir / "plot.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _agent_panel(axis, steps: list[int], rows: list[dict]) -> None:
    """Model turns and tool calls per trajectory and tool errors per step; on the right axis
    the milliseconds per tool call."""
    axis.plot(steps, [r["turns_mean"] for r in rows], color="tab:green", label="model turns")
    axis.plot(steps, [r["tool_calls_mean"] for r in rows], color="tab:orange", label="tool calls")
    axis.plot(steps, [r["tool_errors"] for r in rows], color="tab:red", label="tool errors (step)")
    axis.set_ylabel("per trajectory")
    axis.grid(alpha=0.3)
    axis.legend(loc="best")
    right = axis.twinx()
    right.plot(steps, [1000 * r["tool_time_s"] for r in rows], ":", color="tab:gray")
    right.set_ylabel("ms per tool call (dotted)")


def plot_modes(curves: dict[str, dict[int, list[dict]]], path: Path) -> Path:
    """Render the modes benchmark's curves to ``path``: for each seed a panel of every run's
    reward (its :data:`~rlwire.trainer.outputs.summary.WINDOW`-step moving mean) against
    the training-loop seconds elapsed (``curves``: run label -> seed -> the run's records)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({seed for by_seed in curves.values() for seed in by_seed})
    fig, axes = plt.subplots(1, len(seeds), figsize=(5 * len(seeds), 4), squeeze=False)
    for axis, seed in zip(axes[0], seeds, strict=True):
        for label, by_seed in curves.items():
            curve = reward_curve(by_seed.get(seed, []))
            axis.plot([t for t, _, _ in curve], [mean for _, mean, _ in curve], label=label)
        axis.set_title(f"seed {seed}")
        axis.set_xlabel("training-loop seconds")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"reward ({WINDOW}-step moving mean)")
    axes[0][-1].legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
