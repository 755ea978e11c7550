"""The run's plot: reward (and the validation reward) and policy loss per step, from
``metrics.jsonl``; with multi-turn rollouts also the turns, tool calls and tool errors per
trajectory and the tool time per call."""

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
