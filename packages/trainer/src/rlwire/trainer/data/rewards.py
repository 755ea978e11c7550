"""Rewards: the built-ins (``builtin``, ``gsm8k``, ``math``) and user functions with either
signature, scored into one float per response plus numeric extras for the metrics.

- a *batch* function ``f(prompts, responses, answers) -> list[float]``;
- verl's *per-sample* ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None)`` returning a float or a dict with ``"score"`` (its other numeric entries
  are kept per response: the metrics log their batch means, dynamic sampling may group by
  one). It is told apart by its parameter names.

A value is a number when ``float()`` takes it without parsing text (``int``, ``float``,
``bool``, NumPy and one-element torch scalars); anything else, a string ``"1.0"`` included,
stops the run naming the response.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import RunError
from ..models.tiny import repeat_reward
from ..rollout import Example
from .tasks import builtin_task

if TYPE_CHECKING:
    from ..config.root import TrainerConfig

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


def _as_float(value: Any) -> float | None:
    """``float(value)`` for a number (not parsed from text), else None."""
    if not hasattr(type(value), "__float__"):  # str, None, list, dict: refused
        return None
    try:
        return float(value)
    except (TypeError, ValueError):  # an array of several values, a complex number
        return None


def _listed(values: Any) -> list | None:
    """A batch function's values as a list (from a list, tuple, 1-d tensor or array, or a
    generator); None for text, a mapping or a single value."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        return None
    try:
        return list(values)
    except TypeError:  # a 0-d array or tensor
        return None


def _shown(value: Any) -> str:
    return f"{value!r:.40} (a {type(value).__name__})"


class Reward:
    """A reward function of either signature, called on a batch of examples and responses."""

    def __init__(self, fn: Callable[..., Any], spec: str) -> None:
        self.fn, self.spec = fn, spec
        self.per_sample = _per_sample(fn)

    def __call__(
        self, examples: list[Example], texts: list[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(B,)`` float32 rewards and a per-sample function's numeric extras, ``(B,)``
        float32 each (a key must be a number for every response, or for none: then it is
        left out); a batch function has none."""
        if self.per_sample:
            values, extras = self._samples(examples, texts)
        else:
            values, extras = self._batch(examples, texts), {}
        rewards = torch.tensor(values, dtype=torch.float32)
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        if bad:  # NaN would train on nothing and end "reward nan" with exit 0
            first = bad[0]
            raise RunError(
                f"reward.function {self.spec!r} returned {rewards[first].item()} for response "
                f"{first} (prompt {examples[first].prompt[:60]!r}); rewards must be finite "
                f"numbers ({len(bad)} of {len(texts)} were not)"
            )
        return rewards, extras

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except RunError:  # a built-in's own (math-verify missing)
            raise
        except Exception as err:  # a user function: report it as a run error
            raise RunError(
                f"reward.function {self.spec!r} raised {type(err).__name__}: {err}"
            ) from None

    def _refuse(self, shown: str, index: int, examples: list[Example], allowed: str):
        return RunError(
            f"reward.function {self.spec!r} returned {shown} for response {index} (prompt "
            f"{examples[index].prompt[:60]!r}); {allowed}"
        )

    def _batch(self, examples: list[Example], texts: list[str]) -> list[float]:
        prompts, answers = [e.prompt for e in examples], [e.answer for e in examples]
        out = self._call(prompts, texts, answers)
        allowed = "a batch function returns a list of one number (a float) per response"
        listed = _listed(out)
        if listed is None:
            raise RunError(
                f"reward.function {self.spec!r} returned {_shown(out)} for {len(texts)} "
                f"responses; {allowed}"
            )
        if len(listed) != len(texts):
            raise RunError(
                f"reward.function {self.spec!r} returned ({len(listed)},) values for "
                f"{len(texts)} responses; {allowed}"
            )
        values = []
        for index, value in enumerate(listed):
            number = _as_float(value)
            if number is None:
                raise self._refuse(_shown(value), index, examples, allowed)
            values.append(number)
        return values

    def _samples(self, examples, texts) -> tuple[list[float], dict[str, torch.Tensor]]:
        allowed = "return a number (a float) or a dict with 'score' holding one"
        values: list[float] = []
        extras: list[dict[str, float]] = []
        for index, (example, text) in enumerate(zip(examples, texts, strict=True)):
            out = self._call(
                data_source=example.data_source,
                solution_str=text,
                ground_truth=example.answer,
                extra_info=example.extra_info,
            )
            shown, numbers = _shown(out), {}
            if isinstance(out, dict):
                if "score" not in out:
                    raise RunError(
                        f"reward.function {self.spec!r} returned a dict without 'score' "
                        f"(keys: {sorted(out)}); return a float or a dict with 'score'"
                    )
                numbers = {k: f for k, v in out.items() if (f := _as_float(v)) is not None}
                shown, out = f"a dict whose 'score' is {_shown(out['score'])}", out["score"]
            number = _as_float(out)
            if number is None:
                raise self._refuse(shown, index, examples, allowed)
            values.append(number)
            extras.append({k: v for k, v in numbers.items() if k != "score"})
        return values, self._columns(extras, examples)

    def _columns(self, extras: list[dict[str, float]], examples) -> dict[str, torch.Tensor]:
        """The extras as ``(B,)`` float32 columns; a key given by some responses only stops
        the run (a column with holes could neither be averaged nor grouped by)."""
        keys = sorted({key for sample in extras for key in sample})
        for key in keys:
            has = [key in sample for sample in extras]
            if not all(has):
                raise self._refuse(
                    f"no number for {key!r} (response {has.index(True)} gave one)",
                    has.index(False),
                    examples,
                    "an extra must be a number for every response or for none",
                )
        return {
            key: torch.tensor([sample[key] for sample in extras], dtype=torch.float32)
            for key in keys
        }


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
            if module_spec is None or module_spec.loader is None or not Path(target).is_file():
                raise ImportError(f"no file {target}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as err:
        raise RunError(f"reward.function: cannot import {spec!r}: {err}") from None
    if not callable(fn):
        raise RunError(f"reward.function: {spec!r} is not callable")
    return Reward(fn, spec)
