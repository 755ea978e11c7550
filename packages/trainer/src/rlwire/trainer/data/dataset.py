"""The training data: the built-in task, or a JSONL/Parquet file in a plain or verl layout,
as a deterministic function ``step -> [Example] * data.train_batch_size``.

A row's prompt is a string, or a list of chat messages (verl's layout) rendered with the
model tokenizer's chat template (``add_generation_prompt=True``). Keys may name nested
fields with dots (``reward_model.ground_truth``). With ``data.answer_key`` unset the
ground truth is the row's ``answer``, else verl's ``reward_model.ground_truth``;
``data_source`` and ``extra_info`` are read when present and reach the reward.

A file's prompts are tokenized at start (as the rollout engines will: no special tokens
added) and checked against ``data.max_prompt_length`` and the room the model's context
leaves beside ``rollout.max_new_tokens``: a longer one stops the run naming its row, or is
dropped with ``data.filter_overlong_prompts``. Prompts are never cut.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RunError
from ..rollout import Example
from .readers import is_hub_id, read_rows
from .tasks import BUILTIN_TASKS, builtin_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..config.root import TrainerConfig

__all__ = ["Batches", "load_data", "load_validation"]

log = logging.getLogger("rlwire.trainer")


_ANSWER_KEYS = ("answer", "reward_model.ground_truth")  # tried in order when unset
_MISSING = object()


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

    def __init__(self, model_path: Path, source: Path | str, key: str) -> None:
        self.model_path, self.source, self.key = model_path, source, key
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
                    f"read {self.source}): {err}"
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
        if not getattr(self.tokenizer, "chat_template", None):
            raise RunError(
                f"{self.key}: {self.source} {where}: the prompt is a list of chat messages "
                f"but the tokenizer of {self.model_path} has no chat template; use a model "
                "whose tokenizer_config.json has a 'chat_template', or store the prompts as text"
            )
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # a malformed message list
            raise RunError(
                f"{self.key}: {self.source} {where}: cannot render the chat messages: {err}"
            ) from None


def _example(
    row: Any,
    where: str,
    config: TrainerConfig,
    render: _Renderer,
    path: Path | str,
    key: str,
    needs_answer: bool = True,
):
    if not isinstance(row, Mapping):
        raise RunError(f"{key}: {path} {where} is not an object (a mapping of fields)")
    prompt_key = config.data.prompt_key
    prompt = _field(row, prompt_key)
    answer_keys = (config.data.answer_key,) if config.data.answer_key else _ANSWER_KEYS
    found = [(k, v) for k in answer_keys if (v := _field(row, k)) is not _MISSING]
    answer_key, answer = found[0] if found else ("", _MISSING)
    if prompt is _MISSING or (answer is _MISSING and needs_answer):
        wanted = " or ".join(repr(k) for k in answer_keys)
        raise RunError(f"{key}: {path} {where} lacks {prompt_key!r} or {wanted}")
    if answer is not _MISSING and (
        isinstance(answer, bool) or not isinstance(answer, (str, int, float))
    ):  # None or a list would score as the text "None" / "['7']"
        raise RunError(
            f"{key}: {path} {where}: {answer_key!r} is "
            f"{'null' if answer is None else f'a {type(answer).__name__} ({answer!r:.40})'}; "
            "a ground truth is text or a number"
        )
    if not isinstance(prompt, (str, list, tuple)):
        raise RunError(
            f"{key}: {path} {where}: {prompt_key!r} is a {type(prompt).__name__} "
            f"({prompt!r:.40}); use text or a list of chat messages"
        )
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise RunError(f"{key}: {path} {where}: {prompt_key!r} is empty")
    messages = None
    if isinstance(prompt, (list, tuple)):
        for index, message in enumerate(prompt):
            if not (isinstance(message, Mapping) and "role" in message and "content" in message):
                raise RunError(
                    f"{key}: {path} {where}: {prompt_key!r} item {index} is "
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


def _source(source: str, key: str):
    """The built-in task ``builtin:<name>`` names, the data file ``source``, or the Hub
    dataset id (a str; named ``key`` in the error when it is none of them)."""
    task = builtin_task(source)
    if task is not None:
        return task
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if is_hub_id(source):
        return source
    names = " or ".join(repr(f"builtin:{name}") for name in BUILTIN_TASKS)
    raise RunError(f"{key}: {source!r} is neither {names}, a file, nor a Hub dataset id (org/name)")


def _task_examples(task, count: int, seed: int, source: str) -> list[Example]:
    return task.examples(count, seed, source)


@dataclasses.dataclass(frozen=True, slots=True)
class Batches:
    """The training data as ``step -> [Example] * train_batch_size`` (deterministic in
    step), with the rows of a file or dataset (None: a built-in task's, generated)."""

    size: int
    draw: Callable[[int], list[Example]]
    rows: list[Example] | None = None

    def __call__(self, step: int) -> list[Example]:
        return self.draw(step)

    def epoch_steps(self) -> int | None:
        """Whole batches in one pass over the rows (verl's loader drops a partial last one);
        None for a built-in task."""
        return None if self.rows is None else len(self.rows) // self.size


def load_data(
    config: TrainerConfig,
    model_path: Path,
    *,
    rows: list[Mapping[str, Any]] | None = None,
    needs_answer: bool = True,
) -> Batches:
    """The training batches; every row is read and checked now. ``model_path``: its
    tokenizer renders chat-message prompts. ``rows``: the rows themselves, in place of
    ``data.source`` (the Python API's ``train_dataset``); ``needs_answer``: whether a row
    must carry a ground truth (not for TRL-signature rewards, which read columns)."""
    size, seed = config.data.train_batch_size, config.trainer.seed
    source = config.data.source
    if rows is None:
        found = _source(source, "data.source")
        if not isinstance(found, (Path, str)):

            def generated(step: int) -> list[Example]:
                return _task_examples(found, size, seed * 1_000_003 + step, source)

            return Batches(size, generated)
        read = read_rows(found, "data.source", config.data.subset, config.data.split)
    else:
        found, read = "train_dataset", [(f"row {i}", row) for i, row in enumerate(rows, 1)]
    examples = _checked_rows(config, read, found, model_path, "data.source", needs_answer)

    def batch(step: int) -> list[Example]:
        start = step * size
        return [examples[(start + i) % len(examples)] for i in range(size)]

    return Batches(size, batch, examples)


def _checked_rows(
    config: TrainerConfig,
    read: list[tuple[str, Any]],
    source: Path | str,
    model_path: Path,
    key: str,
    needs_answer: bool,
) -> list[Example]:
    """Every row read from ``source`` (named ``key`` in errors), checked; those whose prompt
    is too long dropped with ``data.filter_overlong_prompts``."""
    render = _Renderer(model_path, source, key)
    rows = [
        (where, _example(row, where, config, render, source, key, needs_answer))
        for where, row in read
    ]
    if not rows:
        raise RunError(f"{key}: {source} holds no rows")
    return _fitting(config, rows, render, model_path, f"{key}: {source}")


def _context(config: TrainerConfig, model_path: Path) -> tuple[int, str] | None:
    """The model's context in tokens and where it is set; None when it is not known."""
    if config.rollout.backend in ("vllm", "vllm_server") and config.rollout.vllm.max_model_len:
        return config.rollout.vllm.max_model_len, "rollout.vllm.max_model_len"
    try:
        fields = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (fields, fields.get("text_config") or {}):
        for name in ("max_position_embeddings", "n_positions"):
            if isinstance(section.get(name), int):
                return section[name], f"{name} of {model_path}"
    return None


def _bounds(config: TrainerConfig, model_path: Path) -> list[tuple[int, str]]:
    """``(most tokens, what sets it and how to lift it)`` for a prompt."""
    bounds = []
    if config.data.max_prompt_length is not None:
        most = config.data.max_prompt_length
        fix = "shorten it, raise data.max_prompt_length"
        bounds.append((most, f"over data.max_prompt_length={most}; {fix}"))
    context = _context(config, model_path)
    if context is not None:
        size, name = context
        room = size - config.rollout.max_new_tokens
        if room < 1:
            raise RunError(
                f"rollout.max_new_tokens={config.rollout.max_new_tokens} leaves no room for "
                f"a prompt in the model's context ({name}: {size}); lower it"
            )
        bounds.append(
            (
                room,
                f"over the {room} the model's context leaves ({name}: {size}, less "
                f"rollout.max_new_tokens={config.rollout.max_new_tokens}); shorten it, "
                "lower rollout.max_new_tokens",
            )
        )
    return bounds


def _fitting(
    config: TrainerConfig,
    rows: list[tuple[str, Example]],
    render: _Renderer,
    model_path: Path,
    source: str,
) -> list[Example]:
    """The examples whose prompt is within every bound (the others dropped with
    ``data.filter_overlong_prompts``, else the first stops the run)."""
    bounds = _bounds(config, model_path)
    if not bounds:
        return [example for _, example in rows]
    lengths = render.lengths([example.prompt for _, example in rows])
    kept = []
    for (where, example), length in zip(rows, lengths, strict=True):
        over = next((text for most, text in bounds if length > most), None)
        if over is None:
            kept.append(example)
        elif not config.data.filter_overlong_prompts:
            raise RunError(
                f"{source} {where}: the prompt is {length} tokens, {over}, or set "
                "data.filter_overlong_prompts=true to drop such rows"
            )
    most = min(m for m, _ in bounds)
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


def load_validation(
    config: TrainerConfig,
    model_path: Path,
    *,
    rows: list[Mapping[str, Any]] | None = None,
    needs_answer: bool = True,
) -> list[Example]:
    """The held-out prompts of ``validation.source`` (or ``rows``: the Python API's
    ``eval_dataset``): every row of a file or dataset, or ``validation.prompts`` of a
    built-in task drawn apart from any training batch."""
    key = "validation.source"
    if rows is not None:
        read = [(f"row {i}", row) for i, row in enumerate(rows, 1)]
        return _checked_rows(config, read, "eval_dataset", model_path, key, needs_answer)
    source = config.validation.source
    assert source is not None, "validation.source: not set (the driver checks)"
    found = _source(source, key)
    if not isinstance(found, (Path, str)):  # training draws seed x 1_000_003 + step, step >= 0
        seed = config.trainer.seed * 1_000_003 - 1
        return _task_examples(found, config.validation.prompts, seed, source)
    read = read_rows(found, key, config.data.subset, config.validation.split)
    return _checked_rows(config, read, found, model_path, key, needs_answer)
