"""What a finished ``rlwire-train`` run shows, as the device check's acceptance table:
``python -m rlwire.trainer.tools.acceptance RUN_DIR [RUN_DIR ...] [--require-rise]``.

For each run directory (its ``metrics.jsonl``): the steps, the mean reward over the first
and the last fifth of the steps (at least one step each), whether it rose, and the weight
sync's share of a step (``time_weight_sync_s`` over the step's three phases, summed over
the run, and over the steps after the first: the first sync also lays out the engine's
buffers). Prints one Markdown table; with ``--out FILE`` also writes it there. Exits 1
when a run has no metrics, or, with ``--require-rise``, when a run's reward did not rise
(a run of a few steps proves nothing either way: the CPU rehearsal leaves it out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main", "summary"]

SYNC_SHARE_TARGET = 0.05
"""Issue 61's bound: the sync under 5% of a step on a GPU."""


def summary(run: Path) -> dict[str, float | int | str]:
    """The acceptance figures of the run in ``run`` (see the module).

    Raises:
        ValueError: the run wrote no metrics.
    """
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    records = [json.loads(line) for line in lines if line.strip()]
    if not records:
        raise ValueError(f"{run}: no metrics.jsonl lines (the run did not train a step)")
    fifth = max(1, len(records) // 5)
    first = sum(r["reward_mean"] for r in records[:fifth]) / fifth
    last = sum(r["reward_mean"] for r in records[-fifth:]) / fifth

    def share(rows: list[dict]) -> float:
        sync = sum(r["time_weight_sync_s"] for r in rows)
        step = sum(r["time_rollout_s"] + r["time_update_s"] + r["time_weight_sync_s"] for r in rows)
        return sync / step if step > 0 else 0.0

    later = records[1:] or records
    return {
        "run": run.name,
        "steps": len(records),
        "reward_first": first,
        "reward_last": last,
        "rose": "yes" if last > first else "no",
        "sync_share": share(records),
        "sync_share_after_first": share(later),
        "senders": max((r.get("weight_sync_senders") or 0) for r in records),
    }


def table(rows: list[dict]) -> str:
    header = (
        "| run | steps | reward, first fifth | reward, last fifth | rose | sync share of a step "
        "| after the first sync | target < 5% | senders |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    body = [
        f"| {r['run']} | {r['steps']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} "
        f"| {r['rose']} | {r['sync_share']:.1%} | {r['sync_share_after_first']:.1%} "
        f"| {'met' if r['sync_share_after_first'] < SYNC_SHARE_TARGET else 'not met'} "
        f"| {r['senders']} |"
        for r in rows
    ]
    return "\n".join([header, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlwire.trainer.tools.acceptance", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (trainer.output_dir)")
    parser.add_argument("--require-rise", action="store_true", help="fail where reward fell")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    rows, failed = [], []
    for run in args.runs:
        try:
            rows.append(summary(run))
        except ValueError as err:
            failed.append(str(err))
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.require_rise:
        failed += [f"{r['run']}: the reward did not rise" for r in rows if r["rose"] != "yes"]
    for line in failed:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
