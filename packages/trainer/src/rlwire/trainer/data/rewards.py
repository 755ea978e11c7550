"""Rewards: one function or several with weights (``reward.function``, ``reward.weights``:
TRL's ``reward_funcs`` and ``reward_weights``), each with one of three signatures, told apart
by its parameter names when it is loaded, before anything starts:

- verl's per-sample ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None)``, returning a float or a dict with ``"score"`` (its other numeric
  entries are kept per response: the metrics log their batch means, dynamic sampling may
  group by one);
- TRL's ``f(prompts, completions, completion_ids, **kwargs)`` over the batch, returning a
  float or None ("not applicable") per completion; every other column of the row is
  passed by name (a named parameter no column fills is refused at start);
- a batch ``f(prompts, responses, answers) -> list[float]``.

Several functions score ``sum(weight x reward)``, a None left out (TRL's ``nansum``); each
one's batch mean is logged (``reward_extra/<name>``). Unset, a built-in task scores with its
own reward and a data file's rows with the scorer their ``data_source`` names
(:mod:`.scorers`).

A value is a number when ``float()`` takes it without parsing text (``int``, ``float``,
``bool``, NumPy and one-element torch scalars); anything else, a string ``"1.0"`` included,
stops the run naming the response.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import RunError
from ..rollout import Example
from .reward_model import RewardModel, is_model_spec, model_device
from .scorers import MATH_INSTALL_HINT, SCORERS, by_data_source, known_sources, unscored_sources
from .tasks import Task, builtin_task

if TYPE_CHECKING:
    from ..config.root import TrainerConfig

__all__ = ["Reward", "Rewards", "load_reward", "signature_kind"]

TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What TRL passes every reward function besides the dataset's columns."""
_SIGNATURES = (
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None), TRL's "
    "f(prompts, completions, completion_ids, **kwargs), or f(prompts, responses, answers)"
)


def signature_kind(fn: Callable[..., Any], spec: str) -> str:
    """``"verl"``, ``"trl"`` or ``"batch"``: which signature ``fn`` has (by its parameter
    names). Raises RunError naming ``spec`` for a function with none of them."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the batch form
        return "batch"
    names = list(signature.parameters)
    if "solution_str" in names or names[:1] == ["data_source"]:
        return "verl"
    if "completions" in names:
        return "trl"
    try:
        signature.bind(None, None, None)
    except TypeError:
        raise RunError(
            f"reward.function {spec!r}: its parameters ({', '.join(names) or 'none'}) fit none "
            f"of the reward signatures: {_SIGNATURES}"
        ) from None
    return "batch"


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
    """One reward function of any of the three signatures, called on a batch."""

    def __init__(self, fn: Callable[..., Any], spec: str) -> None:
        self.fn, self.spec = fn, spec
        self.kind = signature_kind(fn, spec)
        self.name = spec.rpartition(":")[2] or spec
        # a TRL function's parameters, read once: the names its call passes
        self._parameters = inspect.signature(fn).parameters if self.kind == "trl" else {}

    @property
    def per_sample(self) -> bool:
        return self.kind == "verl"

    def needs_answer(self) -> bool:
        """Whether rows must carry a ground truth (TRL's functions read columns instead)."""
        return self.kind != "trl"

    def required_columns(self) -> list[str]:
        """A TRL function's named parameters without a default, which columns must fill."""
        if self.kind != "trl":
            return []
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return [
            name
            for name, p in self._parameters.items()
            if p.kind in kinds and p.default is p.empty and name not in TRL_ARGUMENTS
        ]

    def scores(
        self, examples: list[Example], texts: list[str], ids: Callable[[], list[list[int]]]
    ) -> tuple[list[float | None], dict[str, list[float]]]:
        """Each response's value (None: "not applicable", from a TRL function) and a
        per-sample function's numeric extras."""
        if self.kind == "verl":
            return self._samples(examples, texts)
        if self.kind == "trl":
            return self._trl(examples, texts, ids), {}
        prompts, answers = [e.prompt for e in examples], [e.answer for e in examples]
        allowed = "a batch function returns a list of one number (a float) per response"
        return self._numbers(self._call(prompts, texts, answers), examples, allowed), {}

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

    def _numbers(
        self, out: Any, examples: list[Example], allowed: str, none: bool = False
    ) -> list[float | None]:
        listed = _listed(out)
        if listed is None:
            raise RunError(
                f"reward.function {self.spec!r} returned {_shown(out)} for {len(examples)} "
                f"responses; {allowed}"
            )
        if len(listed) != len(examples):
            raise RunError(
                f"reward.function {self.spec!r} returned ({len(listed)},) values for "
                f"{len(examples)} responses; {allowed}"
            )
        values: list[float | None] = []
        for index, value in enumerate(listed):
            number = _as_float(value)
            if number is None and not (none and value is None):
                raise self._refuse(_shown(value), index, examples, allowed)
            values.append(number)
        return values

    def _trl(self, examples: list[Example], texts: list[str], ids) -> list[float | None]:
        """TRL's call: prompts and completions as the rows gave them (chat messages, or
        text), the completions' token ids, and every column by name."""
        chat = all(e.messages is not None for e in examples)
        prompts = [e.messages if chat else e.prompt for e in examples]
        completions: list[Any] = (
            [[{"role": "assistant", "content": t}] for t in texts] if chat else list(texts)
        )
        columns: dict[str, list[Any]] = {}
        for index, example in enumerate(examples):
            for key, value in (example.columns or {}).items():
                columns.setdefault(key, [None] * len(examples))[index] = value
        arguments = {"prompts": prompts, "completions": completions, "completion_ids": ids()}
        arguments |= {k: v for k, v in columns.items() if k not in arguments}
        parameters = self._parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            arguments = {k: v for k, v in arguments.items() if k in parameters}
        out = self._call(**arguments)
        allowed = "a TRL reward function returns one float (or None) per completion"
        return self._numbers(out, examples, allowed, none=True)

    def _samples(self, examples, texts) -> tuple[list[float | None], dict[str, list[float]]]:
        allowed = "return a number (a float) or a dict with 'score' holding one"
        values: list[float | None] = []
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

    def _columns(self, extras: list[dict[str, float]], examples) -> dict[str, list[float]]:
        """The extras as columns; a key given by some responses only stops the run (a column
        with holes could neither be averaged nor grouped by)."""
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
        return {key: [sample[key] for sample in extras] for key in keys}


class Rewards:
    """What the trainer scores a batch with: ``sum(weight x reward)`` over the functions
    (a None left out), each one's values kept as an extra when there are several."""

    def __init__(self, rewards: Sequence[Reward], weights: Sequence[float] | None = None):
        self.rewards = list(rewards)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.rewards)

    def needs_answer(self) -> bool:
        return any(r.needs_answer() for r in self.rewards)

    def check_rows(self, examples: list[Example], source: str) -> None:
        """Before the run: every row's ``data_source`` has a scorer where one is chosen by it,
        and every column a TRL function names exists."""
        have = set().union(*((e.columns or {}).keys() for e in examples)) if examples else set()
        for reward in self.rewards:
            if reward.fn is by_data_source:
                missing = unscored_sources(e.data_source for e in examples)
                if missing:
                    named = ", ".join(repr(s) for s in missing if s)
                    which = f"whose data_source ({named}) has no built-in scorer" if named else ""
                    if "" in missing:
                        which = "with no data_source" + (f" and rows {which}" if named else "")
                    raise RunError(
                        f"reward.function is unset and {source} has rows {which} (the sources "
                        f"with a scorer: {known_sources()}); set reward.function to gsm8k, "
                        "math or package.module:function"
                    )
            needed = reward.required_columns()
            lacking = [c for c in needed if c not in have]
            if lacking:
                raise RunError(
                    f"reward.function {reward.spec!r} takes {', '.join(map(repr, lacking))}, "
                    f"which no column of {source} fills (its columns: "
                    f"{', '.join(sorted(have)) or 'none'}); give it a default or a **kwargs"
                )

    def __call__(
        self,
        examples: list[Example],
        texts: list[str],
        ids: Callable[[], list[list[int]]] = lambda: [],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(B,)`` float32 rewards and the numeric extras, ``(B,)`` float32 each. ``ids``:
        the responses' token ids, computed on a TRL function's first call, once a batch."""
        ids = functools.cache(ids)
        columns: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(texts), dtype=torch.float64)
        scored = torch.zeros(len(texts), dtype=torch.bool)
        several = len(self.rewards) > 1
        for reward, weight in zip(self.rewards, self.weights, strict=True):
            values, extras = reward.scores(examples, texts, ids)
            given = torch.tensor([v is not None for v in values])
            column = torch.tensor([math.nan if v is None else v for v in values])
            bad = (given & ~column.isfinite()).nonzero().flatten().tolist()
            if bad:  # NaN would train on nothing and end "reward nan" with exit 0
                first = bad[0]
                raise RunError(
                    f"reward.function {reward.spec!r} returned {values[first]} for response "
                    f"{first} (prompt {examples[first].prompt[:60]!r}); rewards must be finite "
                    f"numbers ({len(bad)} of {len(texts)} were not)"
                )
            total += torch.where(given, column.double() * weight, 0.0)
            scored |= given
            prefix = f"{reward.name}/" if several else ""
            columns |= {prefix + k: torch.tensor(v, dtype=torch.float32) for k, v in extras.items()}
            if several:  # its batch mean over the responses it scored
                columns[reward.name] = column.float()
        if not bool(scored.all()):
            first = int((~scored).nonzero()[0])
            names = ", ".join(repr(r.spec) for r in self.rewards)
            raise RunError(
                f"reward.function {names} returned None for response {first} (prompt "
                f"{examples[first].prompt[:60]!r}): no function scored it; one must"
            )
        return total.float(), columns


def _imported(spec: str) -> Callable[..., Any]:
    target, _, name = spec.rpartition(":")
    if not target or not name:
        names = ", ".join(repr(b) for b in ("builtin", *SCORERS))
        raise RunError(
            f"reward.function: {spec!r} is not one of {names}, 'module.path:function' or "
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
    return fn


def _one(spec: str, config: TrainerConfig, task: Task | None) -> Reward:
    if spec == "builtin":
        if task is None:
            raise RunError(
                "reward.function=builtin is the built-in task's reward, and data.source "
                f"{config.data.source!r} is not a built-in task; leave reward.function unset "
                "(each row's data_source chooses the scorer), or name gsm8k, math or "
                "package.module:function"
            )
        return Reward(task.reward, spec)
    if spec in SCORERS:
        if spec == "math" and importlib.util.find_spec("math_verify") is None:
            raise RunError(MATH_INSTALL_HINT)
        return Reward(SCORERS[spec], spec)
    if is_model_spec(spec):
        return _model_reward(spec, config)
    return Reward(_imported(spec), spec)


def _model_reward(spec: str, config: TrainerConfig) -> Reward:
    """The reward model ``spec`` names (a directory, or a Hub id's snapshot), loaded now."""
    from ..models.hub import snapshot

    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        path = snapshot(spec, "reward.model")
    section = config.reward
    model = RewardModel(
        path,
        device=model_device(section.model_device),
        batch_size=section.model_batch_size,
        dtype=config.model.dtype,
    )
    reward = Reward(model, spec)
    reward.name = Path(spec.rstrip("/")).name  # TRL's: the model's name
    return reward


_UNRESOLVED: Any = object()


def load_reward(
    config: TrainerConfig,
    functions: Sequence[Callable[..., Any] | str] | None = None,
    *,
    task: Task | None = _UNRESOLVED,
) -> Rewards:
    """The configured reward (``reward.function`` and ``reward.weights``), imported and its
    signature checked now; ``functions``: callables (or names) given in place of the names
    (the Python API's ``reward_funcs``); ``task``: the built-in task the resolved data
    source is (None: not one; unset: looked up from ``data.source``)."""
    if task is _UNRESOLVED:
        task = builtin_task(config.data.source)
    weights = config.reward.weights
    if functions is not None:
        rewards = [
            _one(fn, config, task)
            if isinstance(fn, str)
            else Reward(fn, getattr(fn, "__name__", type(fn).__name__))
            for fn in functions
        ]
    else:
        specs = config.reward.specs()
        if not specs and config.reward.model is None:  # the task's own, or by data_source
            if task is not None:
                return Rewards([Reward(task.reward, "builtin")])
            return Rewards([Reward(by_data_source, "data_source")])
        rewards = [_one(spec, config, task) for spec in specs]
    if config.reward.model is not None:
        rewards.append(_model_reward(config.reward.model, config))
    if weights is not None and len(weights) != len(rewards):
        raise RunError(
            f"reward.weights: {len(weights)} weights for {len(rewards)} reward functions; "
            "give one per function"
        )
    names = [r.name for r in rewards]
    for index, name in enumerate(names):
        if name in names[:index]:
            rewards[index].name = f"{name}_{index}"
    return Rewards(rewards, weights)
