"""The actor update's speed with and without padding, measured in one run
(``python -m rlwire.trainer.bench --update``).

python -m rlwire.trainer.bench --update [--preset realistic] [--models 64x2,256x4]
                               [--budgets 256,512,1024,16384] [--repeats 5] [--seeds 0]
                               [key=value ...]

Generates one batch of the job (default: ``--preset realistic``, the count task, with
``rollout.max_new_tokens=128``: response lengths with a long tail) with the built-in model
of each ``--models`` size (``HIDDENxLAYERS``, random weights: a random policy ends its
responses after about 26 tokens, a few run to the cap), then times
:func:`rlwire.trainer.algorithms.step.grpo_update` (forward, backward and AdamW step) and
:func:`rlwire.trainer.algorithms.step.compute_old_logprobs` (forward only) on it for: fixed rows
padded
to the batch's longest prompt and response (``actor.micro_batch_size``, the default path);
token-budget micro-batches (``actor.use_dynamic_bsz``) of each ``--budgets`` size; and the
same packed (``actor.use_remove_padding``). Each variant has its own copy of the model and
optimizer; after one warm-up call the variants take turns, ``--repeats`` times, and the
median is kept. Prints real tokens per second (prompt + response tokens from the masks) and
the ratio to the padded fixed rows'. torch runs on 2 threads (``torch.set_num_threads(2)``)
in this one process.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

__all__ = ["update_bench"]


def _batch(config, model, tokenizer, seed: int):
    """One batch of ``config``'s job from ``model``, with its advantages."""
    import torch

    from ..algorithms.advantages import group_advantages
    from ..data.tasks import BUILTIN_TASKS
    from ..rollout import hf_generate

    task = BUILTIN_TASKS[config.data.source.removeprefix("builtin:")]
    pairs = task.prompts(config.data.train_batch_size, seed=seed)
    rollout = hf_generate(
        model,
        tokenizer,
        [p for p, _ in pairs],
        n=config.rollout.n,
        max_new_tokens=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        seed=seed,
    )
    answers = [a for _, a in pairs for _ in range(config.rollout.n)]
    rewards = torch.tensor(task.reward([], rollout.texts, answers))
    return rollout, group_advantages(rewards, config.rollout.n)


def _variants(config, budgets: list[int]) -> list[tuple[str, dict]]:
    rows = config.micro_batch_rows()
    out: list[tuple[str, dict]] = [(f"padded, fixed rows ({rows} a micro-batch)", {})]
    for budget in budgets:
        out.append((f"token budget {budget}", {"max_tokens": budget}))
        out.append(
            (f"token budget {budget}, packed", {"max_tokens": budget, "remove_padding": True})
        )
    return out


def _measure(config, model, rollout, advantages, variants, repeats: int) -> list[dict]:
    """Median seconds of an update and of a forward-only pass, per variant."""
    import torch

    from ..algorithms.micro_batches import split_rows
    from ..algorithms.step import compute_old_logprobs, grpo_update

    temperature, rows = config.rollout.temperature, config.micro_batch_rows()
    old = compute_old_logprobs(model, rollout, micro_batch_size=rows, temperature=temperature)
    runs = []
    for _ in variants:
        policy = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=config.actor.optim.lr)
        runs.append({"policy": policy, "optimizer": optimizer, "update": [], "forward": []})
    for turn in range(repeats + 1):  # turn 0: warm-up
        for run, (_, kwargs) in zip(runs, variants, strict=True):
            start = time.perf_counter()
            grpo_update(
                run["policy"],
                run["optimizer"],
                rollout,
                old,
                advantages,
                micro_batch_size=rows,
                temperature=temperature,
                clip_ratio=config.algorithm.clip_low,
                clip_ratio_high=config.algorithm.clip_high,
                loss_agg=config.algorithm.loss_agg,
                **kwargs,
            )
            middle = time.perf_counter()
            compute_old_logprobs(
                run["policy"], rollout, micro_batch_size=rows, temperature=temperature, **kwargs
            )
            if turn:
                run["update"].append(middle - start)
                run["forward"].append(time.perf_counter() - middle)
    masks = rollout.prompt_mask, rollout.response_mask
    return [
        {
            "update_s": statistics.median(run["update"]),
            "forward_s": statistics.median(run["forward"]),
            "micro_batches": len(
                split_rows(*masks, rows=rows, max_tokens=kwargs.get("max_tokens"))
            ),
        }
        for run, (_, kwargs) in zip(runs, variants, strict=True)
    ]


def update_bench(args: argparse.Namespace, root: Path) -> int:
    """The ``--update`` table (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..config.root import load_config
    from ..models.tiny import build_tiny_model

    torch.set_num_threads(2)
    overrides = ["rollout.max_new_tokens=128", *args.overrides]
    config = load_config(preset=args.preset or "realistic", overrides=overrides)
    budgets = [int(b) for b in args.budgets.split(",")]
    print(
        f"actor update, {config.data.source}, {config.data.train_batch_size} prompts x "
        f"{config.rollout.n}, overrides {overrides}, torch {torch.__version__} on 2 threads, "
        f"median of {args.repeats}"
    )
    print(
        "| model | seed | real / padded tokens | variant | micro-batches | update tokens/s "
        "| vs padded | forward-only tokens/s | vs padded |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        hidden, layers = (int(x) for x in spec.split("x"))
        path = build_tiny_model(root / f"model-{spec}", hidden=hidden, layers=layers)
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        for seed in (int(s) for s in args.seeds.split(",")):
            rollout, advantages = _batch(config, model, tokenizer, seed)
            real = int(rollout.prompt_mask.sum() + rollout.response_mask.sum())
            padded = rollout.prompt_ids.numel() + rollout.response_ids.numel()
            variants = _variants(config, budgets)
            rows = _measure(config, model, rollout, advantages, variants, args.repeats)
            base = rows[0]
            for (label, _), row in zip(variants, rows, strict=True):
                print(
                    f"| {spec} | {seed} | {real} / {padded} | {label} | {row['micro_batches']} "
                    f"| {real / row['update_s']:.0f} | {base['update_s'] / row['update_s']:.2f}x "
                    f"| {real / row['forward_s']:.0f} "
                    f"| {base['forward_s'] / row['forward_s']:.2f}x |"
                )
    return 0
