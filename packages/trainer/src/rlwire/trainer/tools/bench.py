"""The trainer's modes on the same job, measured in one run: speed and learning, per seed.

python -m rlwire.trainer.bench [--preset realistic] [--seeds 0,1,2,3,4] [--steps N]
                               [--workers 1] [--target R] [--variant LABEL:key=value,...]
                               [--modes colocated,one_step_off,fully_async] [key=value ...]
python -m rlwire.trainer.bench --weight-sync [--models 64x2,1024x8] [--backends auto,gloo]
python -m rlwire.trainer.bench --vs trl --trl-python PATH [--models 64x2,640x8] [--seeds
0,1,2]
python -m rlwire.trainer.bench --update [--models 64x2] [--budgets 256,512,1024,16384]
[--repeats 5]
python -m rlwire.trainer.bench --in-flight 1,2,4,8,16,32,64 [--conversations 64] [--threads 1]
python -m rlwire.trainer.bench --reading MODEL_DIR[,MODEL_DIR...] [--conversations 64]
python -m rlwire.trainer.bench --real-model [--trl-python PATH] [--seeds 0,1,2] [--steps 40]
[--modes colocated,fully_async]

Runs the default job (or ``--preset``'s, with the given overrides) with the same steps,
seed and resources as: colocated; one-step off-policy; fully async with its default
off-policy correction (token-level truncated importance sampling, C = 2); and each
``--variant`` (fully async plus its overrides, or the mode they set), for every seed of
``--seeds`` (``--modes`` leaves modes out; colocated, the baseline, always runs; a
variant such as ``LoRA:trainer.mode=colocated,actor.lora.rank=8`` compares a setting
in colocated mode). Prints one row per seed and run: samples/s over the training loop and as a
ratio to colocated's in that seed, the weight-sync share of the loop, the mean version
lag, the final reward (mean over the last tenth of the steps) and its ratio to
colocated's, and the training-loop time until the reward's 10-step moving mean first
reaches the target (``--target``; default 0.8 x colocated's final reward in that seed)
with its ratio to colocated's; then per run the mean and worst ratios over the seeds and
what the driver waited for per step (samples, the actors' update call, the rest of the
update, the weight sync). ``rollout.backend=paced`` gives a generation that takes a set
time per decoding step without using the CPU (a GPU engine or a remote server, as the
trainer sees one).

With ``--weight-sync`` it measures the trainer's weight syncs instead: for each model size
(``HIDDENxLAYERS`` of the built-in Qwen2 architecture) and checkpoint-engine backend, a short
run (10 steps, a tiny batch), the engine's time per sync (median; the first three syncs,
which lay out a zero-copy arena and import what receiving needs, excluded) and its GB/s,
against a plain copy of the same bytes in this process (``dst.copy_(src)`` on one thread, as
each worker computes, after a warm-up copy; median of 5) measured in the same run. "engine s"
is the checkpoint engine's own time (the send until every receiver consumed the update);
"trainer s" the step's whole sync as the trainer waits for it (gathering and exporting on the
actor, the Ray calls, applying on the rollout side).

With ``--vs trl`` it runs the default job (``--steps``, each ``--seeds`` seed, each model size
of ``--models``) as a user would, ``rlwire-train`` from the command line, and then the same
job under TRL's ``GRPOTrainer`` with matched settings (:mod:`rlwire.trainer.tools.vs_trl`, run by
``--trl-python``, an environment with TRL: ``.ci/trl``), one after the other; it prints each
one's training-loop samples/s, whole-command wall time and final reward (mean of the last 10%
of steps) with rlwire's ratios to TRL's, and rlwire's per-step time breakdown.

With ``--update`` it times the actor update alone on one generated batch: padded fixed-row
micro-batches against token-budget ones, plain and packed
(:mod:`rlwire.trainer.tools.bench_update`).

With ``--real-model`` it trains SmolLM2-135M-Instruct (the offline cache of
:mod:`rlwire.trainer.tools.real_model`) on chat-prompted additions, colocated and fully async
and, with ``--trl-python``, under TRL's ``GRPOTrainer`` with the same settings, per seed: the
reward per step (a plot) and the seconds per step (:mod:`rlwire.trainer.tools.bench_real`).

With ``--in-flight`` it measures one ``hf`` engine's samples/s on the lookup task against
the number of conversations in flight (:mod:`rlwire.trainer.tools.bench_inflight`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ..outputs.summary import final_reward, summarise, time_to_target
from ..outputs.summary import records as summary_records
from .bench_modes import compare_modes

__all__ = ["main", "summarise", "time_to_target"]


def _variant(text: str) -> tuple[str, list[str]]:
    label, sep, overrides = text.partition(":")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected LABEL:key=value,...")
    return label, [o for o in overrides.split(",") if o]


def _plain_copy_seconds(nbytes: int) -> float:
    import statistics

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every worker runs (and faster here: no thread wake-ups)
    try:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)  # pages touched once
        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


def weight_sync(args: argparse.Namespace, root: Path) -> int:
    """The ``--weight-sync`` table (see the module docstring)."""
    import statistics

    from ..config.root import load_config
    from ..driver import run
    from ..models.tiny import build_tiny_model

    print(f"trainer weight sync, {args.workers} rollout worker(s), overrides: {args.overrides}")
    print(
        "| model | parameters | bytes | backend | engine s | GB/s | plain copy GB/s | ratio "
        "| trainer s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        hidden, layers = (int(x) for x in spec.split("x"))
        model = build_tiny_model(root / f"model-{spec}", hidden=hidden, layers=layers)
        for backend in args.backends.split(","):
            out = root / f"sync-{spec}-{backend}"
            config = load_config(
                overrides=[
                    f"model.path={model}",
                    "trainer.steps=10",
                    "data.train_batch_size=1",
                    "rollout.n=2",
                    "rollout.max_new_tokens=2",
                    "actor.micro_batch_size=2",
                    f"rollout.num_workers={args.workers}",
                    f"ckpt_engine.backend={backend}",
                    f"trainer.output_dir={out}",
                    "trainer.resume=never",
                    *args.overrides,
                ]
            )
            run(config, progress=False)
            records = summary_records(out)[2:]  # warmed up (first syncs lay out arenas, import)
            nbytes = records[0]["weight_sync_bytes"]
            seconds = statistics.median(nbytes / (r["weight_sync_gbps"] * 1e9) for r in records)
            whole = statistics.median(r["time_weight_sync_s"] for r in records)
            copy = _plain_copy_seconds(nbytes)
            used = (out / "train.log").read_text().split("checkpoint engine: ")[1].split()[0]
            width = 2 if config.model.dtype == "bfloat16" else 4
            print(
                f"| {spec} | {nbytes // width / 1e6:.1f}M | {nbytes / 1e6:.1f} MB | {used} "
                f"| {seconds:.4f} | {nbytes / seconds / 1e9:.2f} | {nbytes / copy / 1e9:.2f} "
                f"| {copy / seconds:.2f}x | {whole:.4f} | {copy / whole:.2f}x |"
            )
    return 0


def reading_bench(models: list[str], count: int, seeds: str) -> int:
    """The lookup task's reading probe (:func:`~rlwire.trainer.agent.lookup.reading_probe`)
    of each model directory: a table row per model and seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..agent.lookup import reading_probe

    print(f"Reading probe: {count} data rows a seed, greedy; the tool returns a wrong code")
    print("| model | seed | key written | answer = tool's code | answer = row's code "
          "| answer = tool's code (row's own) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for path in models:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        for seed in (int(s) for s in seeds.split(",")):
            got = reading_probe(model, tokenizer, count=count, seed=seed)
            print(
                f"| {path} | {seed} | {got['key_written']:.3f} | {got['follows_tool']:.3f} "
                f"| {got['row_code']:.3f} | {got['follows_row_tool']:.3f} |"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlwire.trainer.bench", description=__doc__)
    parser.add_argument("--steps", type=int, default=None, help="default: the job's")
    parser.add_argument("--preset", default=None, help="a named job (rlwire-train --preset)")
    parser.add_argument("--workers", type=int, default=1, help="rollout workers (every run)")
    parser.add_argument("--target", type=float, default=None, help="reward to reach")
    parser.add_argument("--variant", type=_variant, action="append", default=[])
    parser.add_argument(
        "--modes",
        default="colocated,one_step_off,fully_async",
        help="the modes compared (colocated, the baseline, always runs)",
    )
    parser.add_argument("--out", default=None, help="run directories (default: a temp dir)")
    parser.add_argument("--weight-sync", action="store_true", help="measure weight syncs")
    parser.add_argument(
        "--models",
        default=None,
        help="HIDDENxLAYERS,... (default 64x2,1024x8 with --weight-sync, 64x2 with --vs trl; "
        "comparing modes: one size, default the job's model)",
    )
    parser.add_argument("--backends", default="auto,gloo", help="checkpoint engines (sync)")
    parser.add_argument("--vs", choices=["trl"], default=None, help="compare with TRL")
    parser.add_argument("--trl-python", default=None, help="a Python with trl (--vs trl)")
    parser.add_argument("--seeds", default="0", help="seeds, e.g. 0,1,2,3,4")
    parser.add_argument("--update", action="store_true", help="time the actor update")
    parser.add_argument("--budgets", default="256,512,1024,16384", help="tokens (--update)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (--update)")
    parser.add_argument(
        "--in-flight", default=None, help="conversations in flight, e.g. 1,2,4,8 (one engine)"
    )
    parser.add_argument("--conversations", type=int, default=64, help="per point (--in-flight)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (--in-flight)")
    parser.add_argument(
        "--reading", default=None, help="lookup models to probe: do answers follow the tool?"
    )
    parser.add_argument("--real-model", action="store_true", help="SmolLM2 against TRL")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if args.real_model:
        from .bench_real import real_model_bench

        modes = [m for m in args.modes.split(",") if m != "one_step_off"] if args.modes else []
        return real_model_bench(
            Path(args.out or tempfile.mkdtemp(prefix="rlwire-bench-")),
            [int(s) for s in args.seeds.split(",")],
            args.steps or 40,
            modes,
            args.trl_python,
            args.overrides,
        )
    if args.reading:
        return reading_bench(args.reading.split(","), args.conversations, args.seeds)
    if args.in_flight:
        from .bench_inflight import inflight_bench

        return inflight_bench(args, Path(args.out or tempfile.mkdtemp(prefix="rlwire-bench-")))
    if args.weight_sync:
        args.models = args.models or "64x2,1024x8"
        return weight_sync(args, Path(args.out or tempfile.mkdtemp(prefix="rlwire-bench-")))
    if args.update:
        from .bench_update import update_bench

        args.models = args.models or "64x2"
        return update_bench(args, Path(args.out or tempfile.mkdtemp(prefix="rlwire-bench-")))
    if args.vs == "trl":
        args.models = args.models or "64x2"
        args.steps = args.steps or 100
        return vs_trl(args, Path(args.out or tempfile.mkdtemp(prefix="rlwire-bench-")))

    return compare_modes(args, Path(args.out or tempfile.mkdtemp(prefix="rlwire-bench-")))


_PHASES = (  # rlwire's per-step breakdown (metrics.jsonl), in the order a step runs them
    ("generate", "time_rollout_s"),
    ("reward", "time_reward_s"),
    ("old log-probs", "time_old_logprob_s"),
    ("reference", "time_ref_s"),
    ("forward+backward", "time_forward_backward_s"),
    ("optimizer", "time_optimizer_s"),
    ("driver's share of the update", None),
    ("weight export", "time_weight_export_s"),
    ("weight sync", "time_weight_sync_s"),
)


def _breakdown(rows: list[dict]) -> str:
    """Mean milliseconds per step of each phase; the driver's share of the update is the
    update minus the reward and the slowest actor's call (Ray, moving the batch)."""

    def mean(key: str) -> float:
        return 1000 * sum(r.get(key) or 0.0 for r in rows) / len(rows)

    parts = []
    for label, key in _PHASES:
        value = (
            mean("time_update_s") - mean("time_reward_s") - mean("time_actor_s")
            if key is None
            else mean(key)
        )
        parts.append(f"{label} {value:.1f}")
    return ", ".join(parts) + " (ms per step)"


def _timed(cmd: list[str]) -> float | None:
    """Run ``cmd`` to its end; its wall seconds, or None (its error printed) if it failed."""
    import subprocess

    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(f"{cmd[:3]} failed:", done.stderr[-2000:])
        return None
    return time.perf_counter() - start


def vs_trl(args: argparse.Namespace, root: Path) -> int:
    """The ``--vs trl`` table (see the module docstring)."""
    import sys

    from ..models.tiny import build_tiny_model

    if not args.trl_python:
        print("--vs trl needs --trl-python: a Python with trl installed (see .ci/trl)")
        return 2
    print(f"rlwire-train vs TRL GRPOTrainer, {args.steps} steps, overrides: {args.overrides}")
    print(
        "| model | seed | framework | loop samples/s | vs TRL | whole command s | vs TRL "
        "| reward (last 10%) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    breakdowns = []
    for spec in args.models.split(","):
        hidden, layers = (int(x) for x in spec.split("x"))
        model = build_tiny_model(root / f"model-{spec}", hidden=hidden, layers=layers)
        for seed in (int(s) for s in args.seeds.split(",")):
            out = root / f"rlwire-{spec}-{seed}"
            common = [f"model.path={model}", f"trainer.seed={seed}", f"trainer.steps={args.steps}"]
            cli = [sys.executable, "-m", "rlwire.trainer.cli", "--no-progress"]
            wall = _timed([*cli, f"trainer.output_dir={out}", *common, *args.overrides])
            if wall is None:
                return 1
            rows = summary_records(out)
            mine = {**summarise(rows), "wall_s": wall}
            breakdowns.append(f"{spec}, seed {seed}: {_breakdown(rows)}")
            report = root / f"trl-{spec}-{seed}.json"
            job = [args.trl_python, "-m", "rlwire.trainer.tools.vs_trl", str(model), str(report)]
            wall = _timed([*job, "--steps", str(args.steps), "--seed", str(seed)])
            if wall is None:
                return 1
            trl = json.loads(report.read_text())
            trl |= {"wall_s": wall, "reward_final": final_reward(trl["rewards"])}
            for label, r in (("rlwire", mine), (f"TRL {trl['trl']}", trl)):
                print(
                    f"| {spec} | {seed} | {label} | {r['samples_per_s']:.0f} "
                    f"| {r['samples_per_s'] / trl['samples_per_s']:.2f}x | {r['wall_s']:.1f} "
                    f"| {r['wall_s'] / trl['wall_s']:.2f}x | {r['reward_final']:.3f} |"
                )
    print("rlwire's step:", *breakdowns, sep="\n  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
