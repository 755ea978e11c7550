"""Colocated vs fully-async on the same job, measured in one run.

python -m rlwire.trainer.bench [--steps 100] [--workers 1] [--backend hf] [key=value ...]

Runs the default job (or the given overrides) once per mode with the same steps,
seed and resources, then prints one table: samples/s over the training loop, the
fraction of that time spent in weight sync, the mean version lag of the samples
trained on, and the mean reward over the last tenth of the steps; each mode's
samples/s also as a ratio to colocated's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

__all__ = ["main", "summarise"]


def summarise(run_dir: Path) -> dict[str, float]:
    """Loop throughput, sync share, lag and final reward from a run's metrics.jsonl."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # a step's time: getting its samples (generating, or waiting for the queue), the
    # update and the weight sync; samples_per_s was measured over exactly that span
    seconds = [r["time_rollout_s"] + r["time_update_s"] + r["time_weight_sync_s"] for r in records]
    samples = sum(r["samples_per_s"] * t for r, t in zip(records, seconds, strict=True))
    loop_s = sum(seconds)
    tail = records[-max(1, len(records) // 10) :]
    return {
        "steps": len(records),
        "loop_s": loop_s,
        "samples_per_s": samples / loop_s,
        "sync_fraction": sum(r["time_weight_sync_s"] for r in records) / loop_s,
        "lag_mean": sum(r["version_lag_mean"] for r in records) / len(records),
        "reward_final": sum(r["reward_mean"] for r in tail) / len(tail),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlwire.trainer.bench", description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=1, help="rollout workers (both modes)")
    parser.add_argument("--out", default=None, help="run directories (default: a temp dir)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)

    from .config import load_config
    from .driver import run

    root = Path(args.out or tempfile.mkdtemp(prefix="rlwire-bench-"))
    rows = {}
    for mode in ("colocated", "fully_async"):
        config = load_config(
            overrides=[
                *args.overrides,
                f"trainer.mode={mode}",
                f"trainer.steps={args.steps}",
                f"rollout.num_workers={args.workers}",
                f"trainer.output_dir={root / mode}",
                "trainer.resume=never",
            ]
        )
        start = time.perf_counter()
        run(config, progress=False)
        rows[mode] = {**summarise(root / mode), "wall_s": time.perf_counter() - start}
    base = rows["colocated"]["samples_per_s"]
    print(f"{args.steps} steps, {args.workers} rollout worker(s), overrides: {args.overrides}")
    print(
        "| mode | samples/s | vs colocated | weight sync share | mean version lag "
        "| reward (last 10%) | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        print(
            f"| {mode} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base:.2f}x "
            f"| {r['sync_fraction']:.1%} | {r['lag_mean']:.2f} | {r['reward_final']:.3f} "
            f"| {r['wall_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
