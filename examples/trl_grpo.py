"""A TRL user's GRPO script, run by rlwire: TRL's ``GRPOTrainer`` shape, TRL's reward signature
and a ``datasets.Dataset``. Only the import line differs from TRL's quick start.

    uv run python -m examples.trl_grpo                     # the tiny local model, this machine
    uv run python -m examples.trl_grpo --model Qwen/Qwen2.5-0.5B-Instruct --steps 200 \\
        --bf16 --vllm                                       # a real model on a GPU (not yet run)

The dataset: prompts asking for a letter repeated a number of times; the rewards: a TRL
function over the completions and the dataset's ``letter`` and ``count`` columns, and one
for length, weighted.
"""

from __future__ import annotations

import argparse
import random

from rlwire.trainer import GRPOConfig, GRPOTrainer


def repeats(completions, letter, count, **kwargs):
    """1.0 for exactly ``count`` copies of ``letter``; partial credit for the right letter."""
    scores = []
    for text, want, times in zip(completions, letter, count, strict=True):
        body = text.strip()
        if body == want * times:
            scores.append(1.0)
        else:
            scores.append(0.5 * sum(c == want for c in body[:times]) / times)
    return scores


def brevity(completions, **kwargs):
    """A small cost per character past 8 (TRL-style: one float per completion)."""
    return [-0.05 * max(0, len(c) - 8) for c in completions]


def dataset(rows: int, seed: int = 0):
    import datasets

    rng = random.Random(seed)
    letters = "abcdefghij"
    out = []
    for _ in range(rows):
        letter, count = rng.choice(letters), rng.randint(1, 4)
        out.append({"prompt": f"{letter}{count}:", "letter": letter, "count": count})
    return datasets.Dataset.from_list(out)


def build_trainer(args: argparse.Namespace, overrides: list[str] = ()) -> GRPOTrainer:
    config = GRPOConfig(
        output_dir=args.output_dir,
        learning_rate=args.lr,
        num_generations=8,
        per_device_train_batch_size=64,
        max_completion_length=8,
        max_steps=args.steps,
        reward_weights=[1.0, 0.5],
        warmup_steps=5,
        bf16=args.bf16,
        use_vllm=args.vllm,
        overrides=list(overrides),
    )
    return GRPOTrainer(
        model=args.model,
        reward_funcs=[repeats, brevity],
        train_dataset=dataset(256),
        args=config,
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="GRPO in TRL's shape, run by rlwire")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--output-dir", default="runs/trl-grpo")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--vllm", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    result = build_trainer(parse()).train()
    print(f"reward {result.summary['reward_final']:.3f}; run directory {result.run_dir}")
