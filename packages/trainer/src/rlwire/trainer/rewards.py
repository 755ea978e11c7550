"""Rewards: the built-ins (``builtin``, ``gsm8k``, ``math``) and user functions with either
signature, scored into one float per response plus numeric extras for the metrics.

- a *batch* function ``f(prompts, responses, answers) -> list[float]``;
- verl's *per-sample* ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None)`` returning a float or a dict with ``"score"`` (its other numeric entries
  are averaged over the batch into the metrics). It is told apart by its parameter names.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import TrainerConfig
from .errors import RunError
from .rollout import Example
from .tasks import builtin_task
from .tiny import repeat_reward

__all__ = ["Reward", "gsm8k_score", "load_reward", "math_score"]

MATH_INSTALL_HINT = "reward.function=math needs math-verify: pip install 'rlwire-trainer[math]'"

_GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9.,$]+)")


def _number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def gsm8k_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """GSM8K's format: 1.0 when the last ``#### <number>`` of the response equals the
    ground truth (commas and dollar signs ignored), else 0.0."""
    found = _GSM8K_ANSWER.findall(solution_str)
    return float(bool(found) and _number(found[-1]) == _number(str(ground_truth)))


def math_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response's final (boxed) answer is mathematically equal to the ground
    truth, checked with ``math-verify``, else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise RunError(MATH_INSTALL_HINT) from None
    gold = parse(f"${ground_truth}$")
    return float(bool(gold) and verify(gold, parse(solution_str)))


BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "builtin": repeat_reward,
    "gsm8k": gsm8k_score,
    "math": math_score,
}


def _per_sample(fn: Callable[..., Any]) -> bool:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: the batch form
        return False
    return "solution_str" in names or names[:1] == ["data_source"]


class Reward:
    """A reward function of either signature, called on a batch of examples and responses."""

    def __init__(self, fn: Callable[..., Any], spec: str) -> None:
        self.fn, self.spec = fn, spec
        self.per_sample = _per_sample(fn)

    def __call__(
        self, examples: list[Example], texts: list[str]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``(B,)`` float32 rewards and the batch means of a per-sample function's extras."""
        try:
            if self.per_sample:
                values, extras = self._samples(examples, texts)
            else:
                prompts, answers = [e.prompt for e in examples], [e.answer for e in examples]
                values, extras = self.fn(prompts, texts, answers), {}
            rewards = torch.as_tensor([float(v) for v in values], dtype=torch.float32)
        except RunError:
            raise
        except Exception as err:  # a user function: report it as a run error
            raise RunError(f"reward.function raised {type(err).__name__}: {err}") from None
        if rewards.shape != (len(texts),):
            raise RunError(
                f"reward.function returned {tuple(rewards.shape)} values for "
                f"{len(texts)} responses; it must return one float per response"
            )
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        if bad:  # NaN would train on nothing and end "reward nan" with exit 0
            first = bad[0]
            raise RunError(
                f"reward.function {self.spec!r} returned {rewards[first].item()} for response "
                f"{first} (prompt {examples[first].prompt[:60]!r}); rewards must be finite "
                f"numbers ({len(bad)} of {len(texts)} were not)"
            )
        return rewards, extras

    def _samples(self, examples, texts) -> tuple[list[float], dict[str, float]]:
        values: list[float] = []
        sums: dict[str, float] = {}
        for example, text in zip(examples, texts, strict=True):
            out = self.fn(
                data_source=example.data_source,
                solution_str=text,
                ground_truth=example.answer,
                extra_info=example.extra_info,
            )
            if isinstance(out, dict):
                if "score" not in out:
                    raise RunError(
                        f"reward.function {self.spec!r} returned a dict without 'score' "
                        f"(keys: {sorted(out)}); return a float or a dict with 'score'"
                    )
                for key, value in out.items():
                    if key != "score" and isinstance(value, (int, float, bool)):
                        sums[key] = sums.get(key, 0.0) + float(value)
                out = out["score"]
            values.append(out)
        return values, {key: total / len(texts) for key, total in sums.items()}


def load_reward(config: TrainerConfig) -> Reward:
    """The configured reward (``reward.function``), imported and checked now."""
    spec = config.reward.function
    source = config.data.source
    task = builtin_task(source)
    if spec == "builtin" and task is not None:
        return Reward(task.reward, spec)
    if spec in BUILTIN_REWARDS:
        if spec == "math" and importlib.util.find_spec("math_verify") is None:
            raise RunError(MATH_INSTALL_HINT)
        return Reward(BUILTIN_REWARDS[spec], spec)
    target, _, name = spec.rpartition(":")
    if not target or not name:
        builtins = ", ".join(repr(b) for b in BUILTIN_REWARDS)
        raise RunError(
            f"reward.function: {spec!r} is not one of {builtins}, 'module.path:function' or "
            "'file.py:function'"
        )
    try:
        if target.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location("rlwire_user_reward", target)
            if module_spec is None or not Path(target).is_file():
                raise ImportError(f"no file {target}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as err:
        raise RunError(f"reward.function: cannot import {spec!r}: {err}") from None
    if not callable(fn):
        raise RunError(f"reward.function: {spec!r} is not callable")
    return Reward(fn, spec)
