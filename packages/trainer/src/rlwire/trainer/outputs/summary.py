"""What a run's ``metrics.jsonl`` says in a few numbers: the command's closing line and the
benchmarks read the same ones. Also how a resumed run drops the lines after its checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = [
    "WINDOW",
    "drop_metrics_after",
    "final_reward",
    "records",
    "reward_curve",
    "step_seconds",
    "summarise",
    "time_to_target",
]

WINDOW = 10
"""Steps in the reward's moving mean (:func:`time_to_target`)."""


def records(run_dir: Path, *, validation: bool = False) -> list[dict]:
    """The steps' lines of ``run_dir/metrics.jsonl``, or with ``validation`` the validation
    lines (``val/...``: :mod:`rlwire.trainer.runtime.validation`)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    every = [json.loads(x) for x in lines if x.strip()]
    return [r for r in every if ("reward_mean" in r) != validation]


def drop_metrics_after(path: Path, step: int) -> None:
    """Drop the lines of ``metrics.jsonl`` at ``path`` after ``step`` (a resumed run's: those
    written after the checkpoint it continues from, before the stop). The kept lines are
    written to ``<path>.tmp``, flushed and renamed over ``path``: a crash meanwhile leaves
    the old file whole, never a truncated one. (One writer: the run holds its directory's
    lock.)"""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if kept == lines:
        return
    staging = path.with_name(path.name + ".tmp")
    with staging.open("w") as file:
        file.write("".join(line + "\n" for line in kept))
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, path)


def step_seconds(record: dict) -> float:
    """A step's training-loop time: getting its samples (generating, or waiting for the
    queue), the update and the weight sync; ``samples_per_s`` was measured over it."""
    return record["time_rollout_s"] + record["time_update_s"] + record["time_weight_sync_s"]


def reward_curve(rows: list[dict], window: int = WINDOW) -> list[tuple[float, float, int]]:
    """Per step: the training-loop seconds elapsed by its end, the mean reward of the last
    ``window`` steps up to it (fewer at the start), and how many steps that mean is over."""
    curve, elapsed = [], 0.0
    for i, record in enumerate(rows):
        elapsed += step_seconds(record)
        recent = rows[max(0, i + 1 - window) : i + 1]
        curve.append((elapsed, sum(r["reward_mean"] for r in recent) / len(recent), len(recent)))
    return curve


def time_to_target(rows: list[dict], target: float, window: int = WINDOW) -> float | None:
    """Training-loop seconds until the reward's ``window``-step moving mean first reaches
    ``target`` (counted to the end of that step); None if it never does."""
    reached = (t for t, mean, n in reward_curve(rows, window) if n == window and mean >= target)
    return next(reached, None)


def final_reward(rewards: list[float]) -> float:
    """The mean of the last 10% of per-step rewards (at least one)."""
    tail = rewards[-max(1, len(rewards) // 10) :]
    return sum(tail) / len(tail)


def summarise(rows: list[dict]) -> dict[str, float]:
    """Loop throughput (samples over loop seconds, not a mean of per-step rates, which
    over-weights fast steps), sync share, lag and final reward (mean of the last 10% of
    steps) of ``rows`` (records of one run)."""
    seconds = [step_seconds(r) for r in rows]
    samples = sum(r["samples_per_s"] * t for r, t in zip(rows, seconds, strict=True))
    loop_s = sum(seconds)
    return {
        "steps": len(rows),
        "loop_s": loop_s,
        "samples_per_s": samples / loop_s if loop_s > 0 else 0.0,
        "sync_fraction": sum(r["time_weight_sync_s"] for r in rows) / loop_s if loop_s else 0.0,
        "lag_mean": sum(r["version_lag_mean"] for r in rows) / len(rows),
        "reward_final": final_reward([r["reward_mean"] for r in rows]),
    }
