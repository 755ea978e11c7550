"""The default job under TRL's ``GRPOTrainer``, for ``python -m rlwire.trainer.bench --vs
trl``.

``--task arithmetic`` runs the real model's case instead (``python -m rlwire.trainer.bench
--real-model``): the chat prompts of :mod:`rlwire.trainer.tools.arithmetic` in file order, its
reward in TRL's signature, the model in float32 from MODEL_DIR (SmolLM2-135M-Instruct's
folder), with ``--lr``, ``--prompts``, ``--n`` and ``--max-new-tokens`` as given; the rest as
below. OUT.json then also holds each step's seconds (``step_s``, from the trainer's log
times).

Runs in an environment of its own that has TRL (``.ci/trl`` builds one; TRL is never a
dependency of the trainer) with the rlwire packages installed without dependencies:

    python -m rlwire.trainer.tools.vs_trl MODEL_DIR OUT.json [--steps 100] [--seed 0] ...

The same job as ``rlwire-train``'s default, matched setting for setting: the built-in
``repeat`` task's prompts in the order rlwire draws them (``data.train_batch_size``
prompts per step from ``trainer.seed``), its reward, ``rollout.n`` samples per prompt,
``rollout.max_new_tokens`` new tokens at temperature 1 without top-k or top-p, AdamW at a
constant learning rate with no weight decay, gradient clipping at 1, clip ratio 0.2, no
KL term, token-mean loss (TRL's ``dapo``), group-normalised advantages, one update per
batch in one micro-batch, dropout off. Writes the training loop's seconds (``train()``),
samples/s and the per-step rewards to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

__all__ = ["main"]


def _trl():
    try:
        import datasets
        import trl
    except ImportError as err:
        raise SystemExit(
            "rlwire.trainer.tools.vs_trl needs trl and datasets (an environment of their own: "
            f"see .ci/trl): {err}"
        ) from err
    return trl, datasets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlwire.trainer.tools.vs_trl")
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=8, help="data.train_batch_size")
    parser.add_argument("--n", type=int, default=8, help="rollout.n")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--task", choices=["repeat", "arithmetic"], default="repeat")
    args = parser.parse_args(argv)
    trl, datasets = _trl()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from ..models.tiny import repeat_prompts, repeat_reward
    from . import arithmetic

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.task == "arithmetic":
        rows = arithmetic.rows(args.steps * args.prompts, args.seed)
        reward = arithmetic.reward
    else:
        rows = [
            {"prompt": p, "answer": a}
            for step in range(args.steps)
            for p, a in repeat_prompts(args.prompts, seed=args.seed * 1_000_003 + step)
        ]

        def reward(completions, answer, **_) -> list[float]:
            return repeat_reward([], completions, answer)

    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rlwire-vs-trl-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.n,
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=0.2,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        disable_dropout=True,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
    )
    step_ends: list[float] = []

    class StepTimes(TrainerCallback):  # each optimizer step's end
        def on_step_end(self, *_args, **_kwargs):
            step_ends.append(time.perf_counter())

    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
        callbacks=[StepTimes()],
        processing_class=AutoTokenizer.from_pretrained(args.model),
        reward_funcs=reward,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
    )
    start = time.perf_counter()
    trainer.train()
    loop_s = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    starts = [start, *step_ends[:-1]]
    result = {
        "step_s": [end - begin for begin, end in zip(starts, step_ends, strict=True)],
        "steps": len(rewards),
        "loop_s": loop_s,
        "samples_per_s": len(rewards) * args.prompts * args.n / loop_s,
        "rewards": rewards,
        "trl": trl.__version__,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
