"""Rows to examples, one path for training and validation alike: a built-in task's examples
drawn by :func:`task_seed` (the one seed rule), or every row of a :class:`~.sources.Source`
checked, rendered and measured against the prompt limits in a :class:`RowRules`.

A row's prompt is a string, or a list of chat messages (verl's layout) rendered with the
model tokenizer's chat template (``add_generation_prompt=True``). Keys may name nested
fields with dots (``reward_model.ground_truth``). With ``data.answer_key`` unset the
ground truth is the row's ``answer``, else verl's ``reward_model.ground_truth``;
``data_source`` and ``extra_info`` are read when present and reach the reward.

A row's prompt is tokenized at start (as the rollout engines will: no special tokens
added) and checked against ``data.max_prompt_length`` and the room the model's context
leaves beside ``rollout.max_new_tokens``: a longer one stops the run naming its row, or is
dropped with ``data.filter_overlong_prompts``. Prompts are never cut.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RunError
from ..rollout import Example
from .sources import Source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..config.root import TrainerConfig

__all__ = [
    "VALIDATION_STEP",
    "RowRules",
    "examples_of",
    "plain_prompt_note",
    "task_examples",
    "task_seed",
]

log = logging.getLogger("rlwire.trainer")

_ANSWER_KEYS = ("answer", "reward_model.ground_truth")  # tried in order when unset
_MISSING = object()

VALIDATION_STEP = -1
"""The step a built-in task's held-out prompts are drawn as: before every training batch."""


def task_seed(seed: int, step: int) -> int:
    """The seed a built-in task draws batch ``step``'s prompts with (``trainer.seed``
    ``seed``); :data:`VALIDATION_STEP` for the held-out ones, apart from every training
    batch (those are ``step >= 0``)."""
    return seed * 1_000_003 + step


def task_examples(source: Source, count: int, seed: int, step: int) -> list[Example]:
    """``count`` examples of the built-in task ``source`` names, for batch ``step``."""
    assert source.task is not None, f"{source.key}: not a built-in task"
    return source.task.examples(count, task_seed(seed, step), source.spec)


@dataclasses.dataclass(frozen=True, slots=True)
class RowRules:
    """What turning rows into examples reads from the configuration: the keys, whether a
    ground truth is needed, and the prompt limits."""

    prompt_key: str = "prompt"
    answer_keys: tuple[str, ...] = _ANSWER_KEYS
    """Tried in order; the first a row has is its ground truth."""
    needs_answer: bool = True
    """Whether a row must carry a ground truth (not for TRL-signature rewards: columns)."""
    max_prompt_length: int | None = None
    filter_overlong: bool = False
    """Drop an over-long prompt's row (``data.filter_overlong_prompts``) instead of stopping."""
    max_new_tokens: int = 8
    engine_context: tuple[int, str] | None = None
    """The engine's context and its setting (vLLM's ``max_model_len``); None: the model's."""
    truncation: str = "error"
    """``error``, ``left``, ``right`` or ``middle``: what an over-long prompt does when it
    is not dropped (``data.truncation``)."""
    agent: bool = False
    """Multi-turn rollouts start from a row's chat messages (a cut one is refused)."""

    @classmethod
    def of(cls, config: TrainerConfig, *, needs_answer: bool = True) -> RowRules:
        data, rollout = config.data, config.rollout
        engine_context = None
        if rollout.backend in ("vllm", "vllm_server") and rollout.vllm.max_model_len:
            engine_context = (rollout.vllm.max_model_len, "rollout.vllm.max_model_len")
        return cls(
            prompt_key=data.prompt_key,
            answer_keys=(data.answer_key,) if data.answer_key else _ANSWER_KEYS,
            needs_answer=needs_answer,
            max_prompt_length=data.max_prompt_length,
            filter_overlong=data.filter_overlong_prompts,
            max_new_tokens=rollout.max_new_tokens,
            engine_context=engine_context,
            truncation=data.truncation,
            agent=config.agent.enable,
        )


def _field(row: Mapping[str, Any], dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; ``_MISSING`` when any level is absent."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


class _Renderer:
    """Chat messages -> prompt text, and prompts -> token counts, with the model's tokenizer
    (loaded on first use)."""

    def __init__(self, model_path: Path, source: Source) -> None:
        self.model_path, self.source = model_path, source
        self._tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except (OSError, ValueError) as err:
                raise RunError(
                    f"model.path: cannot load the tokenizer of {self.model_path} (needed to "
                    f"read {self.source.label}): {err}"
                ) from None
        return self._tokenizer

    def lengths(self, prompts: list[str]) -> list[int]:
        """Each prompt's token count, as the rollout engines tokenize it."""
        counts: list[int] = []
        for start in range(0, len(prompts), 1024):
            chunk = prompts[start : start + 1024]
            counts += map(len, self.tokenizer(chunk, add_special_tokens=False)["input_ids"])
        return counts

    def __call__(self, messages: list | tuple, where: str) -> str:
        named = f"{self.source.key}: {self.source.label} {where}"
        if not getattr(self.tokenizer, "chat_template", None):
            raise RunError(
                f"{named}: the prompt is a list of chat messages "
                f"but the tokenizer of {self.model_path} has no chat template; use a model "
                "whose tokenizer_config.json has a 'chat_template', or store the prompts as text"
            )
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # a malformed message list
            raise RunError(f"{named}: cannot render the chat messages: {err}") from None


def _example(row: Any, where: str, rules: RowRules, render: _Renderer) -> Example:
    named = f"{render.source.key}: {render.source.label} {where}"
    if not isinstance(row, Mapping):
        raise RunError(f"{named} is not an object (a mapping of fields)")
    prompt_key = rules.prompt_key
    prompt = _field(row, prompt_key)
    found = [(k, v) for k in rules.answer_keys if (v := _field(row, k)) is not _MISSING]
    answer_key, answer = found[0] if found else ("", _MISSING)
    if prompt is _MISSING or (answer is _MISSING and rules.needs_answer):
        wanted = " or ".join(repr(k) for k in rules.answer_keys)
        raise RunError(f"{named} lacks {prompt_key!r} or {wanted}")
    if answer is not _MISSING and (
        isinstance(answer, bool) or not isinstance(answer, (str, int, float))
    ):  # None or a list would score as the text "None" / "['7']"
        raise RunError(
            f"{named}: {answer_key!r} is "
            f"{'null' if answer is None else f'a {type(answer).__name__} ({answer!r:.40})'}; "
            "a ground truth is text or a number"
        )
    if not isinstance(prompt, (str, list, tuple)):
        raise RunError(
            f"{named}: {prompt_key!r} is a {type(prompt).__name__} "
            f"({prompt!r:.40}); use text or a list of chat messages"
        )
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise RunError(f"{named}: {prompt_key!r} is empty")
    messages = None
    if isinstance(prompt, (list, tuple)):
        for index, message in enumerate(prompt):
            if not (isinstance(message, Mapping) and "role" in message and "content" in message):
                raise RunError(
                    f"{named}: {prompt_key!r} item {index} is "
                    f"{message!r:.40}; chat messages are objects with 'role' and 'content'"
                )
        messages = [dict(m) for m in prompt]
        prompt = render(prompt, where)
    source = _field(row, "data_source")
    extra = _field(row, "extra_info")
    return Example(
        prompt=str(prompt),
        answer="" if answer is _MISSING else str(answer),
        data_source="" if source is _MISSING else str(source),
        extra_info=dict(extra) if isinstance(extra, Mapping) else None,
        messages=messages,
        columns={k: v for k, v in row.items() if k != prompt_key},
    )


def examples_of(
    source: Source, rules: RowRules, model_path: Path, subset: str | None, split: str
) -> list[Example]:
    """Every row of ``source`` (``subset`` and ``split``: a Hub dataset's) as an example,
    checked; those whose prompt is too long dropped with ``rules.filter_overlong``.
    ``model_path``: its tokenizer renders chat messages and measures the prompts."""
    if source.parts:  # one data set, each part checked as itself (errors name its file)
        return [e for p in source.parts for e in examples_of(p, rules, model_path, subset, split)]
    render = _Renderer(model_path, source)
    read = source.read(subset, split)
    rows = [(where, _example(row, where, rules, render)) for where, row in read]
    if not rows:
        raise RunError(f"{source.key}: {source.label} holds no rows")
    return _fitting(rules, rows, render, model_path, f"{source.key}: {source.label}")


def _cut(example: Example, most: int, rules: RowRules, render: _Renderer, where: str) -> Example:
    """``example`` with its prompt cut to ``most`` tokens as ``rules.truncation`` says
    (decoded back to text: a few tokens more are cut where the text tokenizes longer)."""
    if rules.agent and example.messages is not None:
        raise RunError(
            f"{where}: the prompt is over {most} tokens, and data.truncation cuts the rendered "
            "text while agent conversations start from the row's chat messages; shorten them, "
            "or set data.filter_overlong_prompts=true to drop such rows"
        )
    tokenizer = render.tokenizer
    ids = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
    for keep in range(most, max(most - 8, 0), -1):
        if rules.truncation == "left":
            part = ids[len(ids) - keep :]
        elif rules.truncation == "right":
            part = ids[:keep]
        else:  # middle: the first and the last halves
            part = ids[: (keep + 1) // 2] + ids[len(ids) - keep // 2 :]
        text = tokenizer.decode(part, skip_special_tokens=False)
        if text.strip() and render.lengths([text])[0] <= most:
            return dataclasses.replace(example, prompt=text, messages=None)
    raise RunError(f"{where}: the prompt cannot be cut to {most} tokens (data.truncation)")


def _context(rules: RowRules, model_path: Path) -> tuple[int, str] | None:
    """The model's context in tokens and where it is set; None when it is not known."""
    if rules.engine_context is not None:
        return rules.engine_context
    try:
        fields = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (fields, fields.get("text_config") or {}):
        for name in ("max_position_embeddings", "n_positions"):
            if isinstance(section.get(name), int):
                return section[name], f"{name} of {model_path}"
    return None


def _bounds(rules: RowRules, model_path: Path) -> list[tuple[int, str]]:
    """``(most tokens, what sets it and how to lift it)`` for a prompt."""
    bounds = []
    if rules.max_prompt_length is not None:
        most = rules.max_prompt_length
        fix = "shorten it, raise data.max_prompt_length"
        bounds.append((most, f"over data.max_prompt_length={most}; {fix}"))
    context = _context(rules, model_path)
    if context is not None:
        size, name = context
        new = rules.max_new_tokens
        room = size - new
        if room < 1:
            raise RunError(
                f"rollout.max_new_tokens={new} leaves no room for "
                f"a prompt in the model's context ({name}: {size}); lower it"
            )
        bounds.append(
            (
                room,
                f"over the {room} the model's context leaves ({name}: {size}, less "
                f"rollout.max_new_tokens={new}); shorten it, lower rollout.max_new_tokens",
            )
        )
    return bounds


def _fitting(
    rules: RowRules,
    rows: list[tuple[str, Example]],
    render: _Renderer,
    model_path: Path,
    source: str,
) -> list[Example]:
    """The examples whose prompt is within every bound (the others dropped with
    ``rules.filter_overlong``, else the first stops the run)."""
    bounds = _bounds(rules, model_path)
    if not bounds:
        return [example for _, example in rows]
    lengths = render.lengths([example.prompt for _, example in rows])
    most = min(m for m, _ in bounds)
    kept, cut = [], 0
    for (where, example), length in zip(rows, lengths, strict=True):
        over = next((text for most, text in bounds if length > most), None)
        if over is None:
            kept.append(example)
        elif rules.filter_overlong:
            continue
        elif rules.truncation != "error":
            kept.append(_cut(example, most, rules, render, f"{source} {where}"))
            cut += 1
        else:
            raise RunError(
                f"{source} {where}: the prompt is {length} tokens, {over}, or set "
                "data.filter_overlong_prompts=true to drop such rows (or data.truncation "
                "to cut them)"
            )
    if cut:
        log.warning(
            "%s: cut %d of %d prompts to %d tokens (data.truncation=%s)",
            source,
            cut,
            len(rows),
            most,
            rules.truncation,
        )
    if not kept:
        raise RunError(
            f"{source}: every prompt is over {most} tokens (data.filter_overlong_prompts "
            "dropped them all)"
        )
    if len(kept) < len(rows):
        log.warning(
            "%s: dropped %d of %d rows whose prompt is over %d tokens "
            "(data.filter_overlong_prompts)",
            source,
            len(rows) - len(kept),
            len(rows),
            most,
        )
    return kept


def plain_prompt_note(examples: Sequence[Example], model_path: Path) -> str | None:
    """A one-line note when prompts given as plain text go to a model whose tokenizer has a
    chat template: they reach it raw, without the template (as TRL's standard format does),
    and an instruct model continues the text instead of answering. None otherwise."""
    plain = sum(example.messages is None for example in examples)
    if not plain:
        return None
    try:
        from transformers import AutoTokenizer

        template = getattr(AutoTokenizer.from_pretrained(model_path), "chat_template", None)
    except Exception:  # a tokenizer that does not load is reported where it is needed
        return None
    if not template:
        return None
    return (
        f"{plain} of {len(examples)} prompts are plain text and reach {model_path.name} "
        "without its chat template; an instruct model answers prompts given as chat messages "
        '(a list of {"role": "user", "content": ...}, rendered with the template)'
    )
