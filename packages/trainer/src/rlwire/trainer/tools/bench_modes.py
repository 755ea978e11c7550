"""``python -m rlwire.trainer.bench`` without ``--weight-sync`` or ``--vs``: the modes on one
job, per seed, measured in one run (see :mod:`rlwire.trainer.tools.bench`)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ..outputs.plot import plot_modes
from ..outputs.summary import WINDOW, summarise, time_to_target
from ..outputs.summary import records as summary_records

__all__ = ["MODE_RUNS", "compare_modes"]

MODE_RUNS: list[tuple[str, list[str]]] = [
    ("colocated", ["trainer.mode=colocated"]),
    ("one_step_off", ["trainer.mode=one_step_off"]),
    ("fully_async", ["trainer.mode=fully_async"]),
]
"""Every comparison's runs; ``--variant`` adds fully-async ones (or any mode it sets)."""


def _orchestration(rows: list[dict], engines: int, *, serial: bool) -> dict[str, float]:
    """Mean milliseconds per step: the driver's wait for samples, the actors' update call,
    the rest of the update (scoring, moving the batch, Ray), the driver's wait for the weight
    sync, and the step as a whole; the generation behind a step's samples divided over the
    ``engines`` (the rollout engines' own time: they run side by side); the rollout workers'
    time paused by the staleness bound and waiting at a boundary for a sync's weights
    (fully async; summed over the workers); the mean megabytes a weight sync carried; and
    the stage-time bound: the slowest of the update, the generation over the engines and the
    sync, or with ``serial`` (colocated mode, which runs them one after another) their sum."""

    def mean(key: str) -> float:
        return 1000 * sum(r.get(key) or 0.0 for r in rows) / len(rows)

    synced = [r["weight_sync_bytes"] for r in rows if r.get("weight_sync_bytes")]
    update, sync = mean("time_update_s"), mean("time_weight_sync_s")
    generation = mean("time_generate_s") / engines
    return {
        "sync_mb": sum(synced) / len(synced) / 1e6 if synced else 0.0,
        "samples": mean("time_rollout_s"),
        "actor": mean("time_actor_s"),
        "driver": update - mean("time_actor_s"),
        "sync": sync,
        "step": mean("time_rollout_s") + update + sync,
        "generation": generation,
        "paused": mean("rollout_paused_s"),
        "sync_wait": mean("rollout_sync_wait_s"),
        "bound": update + generation + sync if serial else max(update, generation, sync),
    }


def _engines(config) -> int:
    """The rollout engines generating side by side: one per actor rank with the hybrid
    engine, else the rollout workers."""
    return config.actor.world_size if config.hybrid_engine() else config.rollout.num_workers


def compare_modes(args: argparse.Namespace, root: Path) -> int:
    """Run colocated, one-step off-policy, fully async and each ``--variant`` on the job
    (``--preset``, overrides) for every seed of ``--seeds``; print the per-seed table, then
    each run's mean and worst ratios to colocated and its per-step orchestration."""
    from ..config.root import load_config
    from ..driver import run

    modes = {"colocated", *args.modes.split(",")}
    unknown = modes - {label for label, _ in MODE_RUNS}
    if unknown:
        raise SystemExit(f"--modes: {sorted(unknown)} unknown; use {[m for m, _ in MODE_RUNS]}")
    runs = [
        *[(label, settings) for label, settings in MODE_RUNS if label in modes],
        *[(label, ["trainer.mode=fully_async", *more]) for label, more in args.variant],
    ]
    seeds = [int(s) for s in args.seeds.split(",")]
    model = []
    if args.models:  # one size of the built-in architecture (random weights, as `tiny`)
        from ..models.tiny import build_tiny_model

        hidden, layers = (int(x) for x in args.models.split("x"))
        path = build_tiny_model(root / f"model-{args.models}", hidden=hidden, layers=layers)
        model = [f"model.path={path}"]
    rows: dict[tuple[str, int], dict] = {}
    kept: dict[tuple[str, int], list[dict]] = {}
    engines: dict[str, int] = {}
    serial: dict[str, bool] = {}  # colocated runs: the stages one after another
    print(
        f"preset: {args.preset}, model: {args.models or 'default'}, overrides: "
        f"{args.overrides}, {args.workers} rollout worker(s), seeds {seeds}"
    )
    print(
        "| seed | run | samples/s | vs colocated | sync share | mean lag | reward (last 10%) "
        "| vs colocated | loop s to target | vs colocated | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        for i, (label, settings) in enumerate(runs):
            out = root / f"seed{seed}-run{i}"
            extra = [f"trainer.steps={args.steps}"] if args.steps else []
            config = load_config(
                overrides=[
                    *model,
                    *args.overrides,
                    *settings,
                    *extra,
                    f"trainer.seed={seed}",
                    f"rollout.num_workers={args.workers}",
                    f"trainer.output_dir={out}",
                    "trainer.resume=never",
                ],
                preset=args.preset,
            )
            engines[label] = _engines(config)
            serial[label] = config.trainer.mode == "colocated"
            start = time.perf_counter()
            run(config, progress=False)
            kept[label, seed] = summary_records(out)
            rows[label, seed] = {
                **summarise(kept[label, seed]),
                "wall_s": time.perf_counter() - start,
            }
        base = rows["colocated", seed]
        target = args.target if args.target is not None else 0.8 * base["reward_final"]
        t0 = time_to_target(kept["colocated", seed], target)
        for label, _ in runs:
            r = rows[label, seed]
            t = time_to_target(kept[label, seed], target)
            r["speed"] = r["samples_per_s"] / base["samples_per_s"]
            r["reward"] = r["reward_final"] / base["reward_final"] if base["reward_final"] else 0.0
            r["to_target"] = t / t0 if t is not None and t0 else None
            reached = "not reached" if t is None else f"{t:.1f}"
            ratio = "-" if r["to_target"] is None else f"{r['to_target']:.2f}x"
            print(
                f"| {seed} | {label} | {r['samples_per_s']:.1f} | {r['speed']:.2f}x "
                f"| {r['sync_fraction']:.1%} | {r['lag_mean']:.2f} | {r['reward_final']:.3f} "
                f"| {r['reward']:.2f}x | {reached} | {ratio} | {r['wall_s']:.1f} |",
                flush=True,
            )
    print(f"\ntarget: 0.8 x colocated's final reward in the same seed ({WINDOW}-step moving mean)")
    print(
        "| run | samples/s vs colocated (mean) | reward vs colocated: mean | worst "
        "| time to target vs colocated: mean | worst |"
    )
    print("|---|---|---|---|---|---|")
    costs = {}
    for label, _ in runs:
        mine = [rows[label, s] for s in seeds]
        ratios = [r["to_target"] for r in mine if r["to_target"] is not None]
        times = (
            f"{statistics.mean(ratios):.2f}x | {max(ratios):.2f}x"
            + ("" if len(ratios) == len(mine) else f" ({len(mine) - len(ratios)} not reached)")
            if ratios
            else "not reached | -"
        )
        steps = [r for s in seeds for r in kept[label, s]]
        costs[label] = _orchestration(steps, engines[label], serial=serial[label])
        print(
            f"| {label} | {statistics.mean(r['speed'] for r in mine):.2f}x "
            f"| {statistics.mean(r['reward'] for r in mine):.2f}x "
            f"| {min(r['reward'] for r in mine):.2f}x | {times} |"
        )
    _print_bounds(runs, seeds, rows, costs, engines)
    curves = {label: {seed: kept[label, seed] for seed in seeds} for label, _ in runs}
    print(f"\nreward over training-loop time: {plot_modes(curves, root / 'modes.png')}")
    return 0


def _print_bounds(runs, seeds, rows, costs, engines) -> None:
    """Each run against the bound its own stage times allow, and where its steps went."""
    print(
        "\nbound: the slowest stage per step (update, generation over the engines, sync), "
        "measured in the same run; in colocated mode: their sum"
    )
    print(
        "| run | engines | samples/s | bound samples/s | of bound | per step, ms: step "
        "| samples wait | update (actors' call) | driver's share | sync wait "
        "| generation / engines | workers paused | workers' sync wait | MB per sync |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, _ in runs:
        cost = costs[label]
        speed = statistics.mean(rows[label, s]["samples_per_s"] for s in seeds)
        bound = speed * cost["step"] / cost["bound"] if cost["bound"] else 0.0
        print(
            f"| {label} | {engines[label]} | {speed:.1f} | {bound:.1f} "
            f"| {speed / bound if bound else 0.0:.2f} | {cost['step']:.1f} "
            f"| {cost['samples']:.1f} | {cost['driver'] + cost['actor']:.1f} ({cost['actor']:.1f}) "
            f"| {cost['driver']:.1f} | {cost['sync']:.1f} | {cost['generation']:.1f} "
            f"| {cost['paused']:.1f} | {cost['sync_wait']:.1f} | {cost['sync_mb']:.3f} |"
        )
