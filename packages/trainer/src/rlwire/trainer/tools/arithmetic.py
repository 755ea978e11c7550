"""The real model's task: two-number additions asked as chat messages, and its reward in
TRL's signature, shared by the real-model tests, the benchmark (``python -m
rlwire.trainer.bench --real-model``, the same rows and reward under TRL's ``GRPOTrainer``)
and the documentation's first real run.

Each row: ``{"prompt": [{"role": "user", "content": "What is 7 + 12? Reply with the number
only."}], "answer": "19"}``. The reward: 1 when the reply's last number is the sum ("7 + 12
= 19." counts), plus 0.5 when the reply is a number alone (the format asked for); 0
otherwise.
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
    """TRL's signature: 1 when the last number in the reply is ``answer``, plus 0.5 when the
    reply is a number alone (spaces and a final period aside)."""
    scores = []
    for completion, truth in zip(completions, answer, strict=True):
        text = _text(completion).strip()
        numbers = _NUMBER.findall(text)
        right = bool(numbers) and numbers[-1] == str(truth)
        bare = _NUMBER.fullmatch(text.rstrip(".").strip()) is not None
        scores.append((1.0 if right else 0.0) + (0.5 if bare else 0.0))
    return scores
