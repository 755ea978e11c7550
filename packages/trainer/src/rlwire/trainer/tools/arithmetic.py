"""The real model's task: two-number additions asked as chat messages, and its reward in
TRL's signature, shared by the real-model tests, the benchmark (``python -m
rlwire.trainer.bench --real-model``, the same rows and reward under TRL's ``GRPOTrainer``)
and the documentation's first real run.

Each row: ``{"prompt": [{"role": "user", "content": "What is 7 + 12? Reply with the number
only."}], "answer": "19"}``. The reward: 1 for the right number, plus 0.5 when the reply is
the bare number (its format); 0 otherwise. SmolLM2-135M-Instruct answers about 1 in 8 right
and bare at temperature 1 before training.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

__all__ = ["reward", "rows", "write_rows"]

QUESTION = "What is {a} + {b}? Reply with the number only."
_NUMBER = re.compile(r"-?\d+")


def rows(count: int, seed: int, *, most: int = 20) -> list[dict[str, Any]]:
    """``count`` rows of additions of two numbers in ``1..most``, drawn from ``seed``."""
    draw = random.Random(f"rlwire arithmetic {seed}")
    out = []
    for _ in range(count):
        a, b = draw.randint(1, most), draw.randint(1, most)
        prompt = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
        out.append({"prompt": prompt, "answer": str(a + b)})
    return out


def write_rows(path: Path, count: int, seed: int) -> Path:
    """:func:`rows` as a JSONL file at ``path``."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(count, seed)))
    return path


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # a conversational completion: its assistant turn
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL's signature: 1 when the first number in the reply is ``answer``, plus 0.5 when the
    reply is that number alone (spaces and a final period aside)."""
    scores = []
    for completion, truth in zip(completions, answer, strict=True):
        text = _text(completion).strip()
        first = _NUMBER.search(text)
        right = first is not None and first.group() == str(truth)
        bare = _NUMBER.fullmatch(text.rstrip(".").strip()) is not None
        scores.append((1.0 if right else 0.0) + (0.5 if bare else 0.0))
    return scores
