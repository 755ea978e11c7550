"""The real model's benchmark: SmolLM2-135M-Instruct learning two-number additions asked as
chat messages (:mod:`.arithmetic`), under ``rlwire-train`` (colocated and fully async) and
under TRL's ``GRPOTrainer`` (:mod:`.vs_trl` ``--task arithmetic``, in an environment with TRL:
``.ci/trl``), seed by seed, one run after the other on this machine.

    python -m rlwire.trainer.bench --real-model [--trl-python PATH] [--seeds 0,1,2]
        [--steps 40] [--modes colocated,fully_async] [--out DIR] [key=value ...]

Every run: the model in float32 from the offline cache (:mod:`.real_model`), the same rows in
the same order (``data.shuffle=false``; TRL's ``shuffle_dataset=False``), the same reward,
:data:`SETTINGS` (prompts, generations, lengths, learning rate, temperature, beta 0,
constant learning rate, one update per batch), the seed. Each process gets its share of the
cores: TRL's one process both (``--threads`` = the machine's cores), rlwire's worker
processes ``ray.worker_threads`` automatic (colocated: the one actor rank holding its engine,
all cores; fully async: the actor rank and the rollout worker, half each).

Prints one row per seed and run (seconds per step: the loop's mean, generation, scoring,
update and optimizer end to end; the mean reward of the first 5 and the last 10 steps), the
ratios to TRL's in that seed, rlwire's time per phase; writes ``real-model.json`` (every
step's reward and seconds) and ``real-model.png`` (the reward per step, the mean over the
seeds of each run, each seed faint) to ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..outputs.summary import records as summary_records
from ..outputs.summary import step_seconds
from . import arithmetic, real_model

__all__ = ["SETTINGS", "real_model_bench"]

SETTINGS: dict[str, int | float] = {"prompts": 2, "n": 4, "max_new_tokens": 16, "lr": 2e-5}
"""The case's shape: prompts per step, answers per prompt, new tokens, learning rate."""

PHASES = ("time_rollout_s", "time_reward_s", "time_forward_backward_s", "time_optimizer_s")


def _rlwire(model: Path, rows: Path, out: Path, seed: int, steps: int, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "rlwire.trainer.cli",
        "--no-progress",
        f"trainer.output_dir={out}",
        f"model.path={model}",
        f"data.source={rows}",
        "data.shuffle=false",
        "reward.function=rlwire.trainer.tools.arithmetic:reward",
        f"data.train_batch_size={SETTINGS['prompts']}",
        f"rollout.n={SETTINGS['n']}",
        f"rollout.max_new_tokens={SETTINGS['max_new_tokens']}",
        f"actor.optim.lr={SETTINGS['lr']}",
        "actor.optim.lr_scheduler_type=constant",
        "rollout.temperature=1.0",
        "algorithm.kl_coef=0.0",
        f"trainer.seed={seed}",
        f"trainer.steps={steps}",
        "trainer.save_every=0",
        *extra,
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"rlwire-train failed: {done.stderr[-3000:]}")
    rows_ = summary_records(out)
    return {
        "wall_s": time.perf_counter() - start,
        "rewards": [r["reward_mean"] for r in rows_],
        "step_s": [step_seconds(r) for r in rows_],
        "phases": {k: statistics.fmean(r.get(k, 0.0) for r in rows_) for k in PHASES},
    }


def _trl(python: str, model: Path, out: Path, seed: int, steps: int) -> dict:
    report = out.with_suffix(".json")
    cmd = [
        python,
        "-m",
        "rlwire.trainer.tools.vs_trl",
        str(model),
        str(report),
        "--task",
        "arithmetic",
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--prompts",
        str(SETTINGS["prompts"]),
        "--n",
        str(SETTINGS["n"]),
        "--max-new-tokens",
        str(SETTINGS["max_new_tokens"]),
        "--lr",
        str(SETTINGS["lr"]),
        "--threads",
        str(os.cpu_count() or 1),
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"TRL failed: {done.stderr[-3000:]}")
    result = json.loads(report.read_text())
    return {"wall_s": time.perf_counter() - start, **result}


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def real_model_bench(
    root: Path,
    seeds: list[int],
    steps: int,
    modes: list[str],
    trl_python: str | None,
    overrides: list[str],
) -> int:
    """Run the case (see the module docstring); 0 when every run finished."""
    model = real_model.snapshot_dir()
    if not real_model.is_built():
        print(
            "the real model's cache is not built: uv run python -m rlwire.trainer.tools.real_model"
        )
        return 2
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, dict]] = {}
    for seed in seeds:
        data = arithmetic.write_rows(
            root / f"rows-{seed}.jsonl", steps * int(SETTINGS["prompts"]), seed
        )
        if trl_python:
            runs.setdefault("TRL", {})[seed] = _trl(
                trl_python, model, root / f"trl-{seed}", seed, steps
            )
        for mode in modes:
            out = root / f"{mode}-{seed}"
            extra = [f"trainer.mode={mode}", *overrides]
            runs.setdefault(mode, {})[seed] = _rlwire(model, data, out, seed, steps, extra)
    print(f"SmolLM2-135M-Instruct, arithmetic, {SETTINGS}, {steps} steps, seeds {seeds}")
    print("| seed | run | s per step | vs TRL | reward, steps 1-5 | reward, last 10 | vs TRL |")
    print("|---|---|---|---|---|---|---|")
    for seed in seeds:
        trl = runs.get("TRL", {}).get(seed)
        for label, by_seed in runs.items():
            r = by_seed[seed]
            step, first, last = (
                _mean(r["step_s"]),
                _mean(r["rewards"][:5]),
                _mean(r["rewards"][-10:]),
            )
            vs = f"{step / _mean(trl['step_s']):.2f}x" if trl else "-"
            vs_reward = f"{last - _mean(trl['rewards'][-10:]):+.3f}" if trl else "-"
            print(
                f"| {seed} | {label} | {step:.2f} | {vs} | {first:.3f} | {last:.3f} | {vs_reward} |"
            )
    for label, by_seed in runs.items():
        finals = [_mean(r["rewards"][-10:]) for r in by_seed.values()]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        steps_s = [_mean(r["step_s"]) for r in by_seed.values()]
        print(
            f"{label}: reward last 10 {_mean(finals):.3f} (sd {spread:.3f} over seeds), "
            f"{_mean(steps_s):.2f} s per step"
        )
        phases = [r["phases"] for r in by_seed.values() if "phases" in r]
        if phases:
            parts = ", ".join(f"{k[5:-2]} {_mean([p[k] for p in phases]):.2f} s" for k in PHASES)
            print(f"  rlwire's step: {parts}")
    (root / "real-model.json").write_text(json.dumps({"settings": SETTINGS, "runs": runs}))
    _plot(runs, root / "real-model.png")
    print(f"wrote {root / 'real-model.json'} and {root / 'real-model.png'}")
    return 0


def _plot(runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for (label, by_seed), colour in zip(runs.items(), ("C0", "C1", "C2", "C3"), strict=False):
        curves = [r["rewards"] for r in by_seed.values()]
        for curve in curves:
            axes.plot(range(1, len(curve) + 1), curve, color=colour, alpha=0.2, linewidth=0.8)
        length = min(len(c) for c in curves)
        mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
        axes.plot(
            range(1, length + 1), mean, color=colour, label=f"{label} (mean of {len(curves)})"
        )
    axes.set_xlabel("step")
    axes.set_ylabel("mean reward")
    axes.set_title("SmolLM2-135M-Instruct, 2-number additions (chat), CPU")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
