"""The training data: the built-in task, or a JSONL/Parquet file in a plain or verl layout,
as a deterministic function ``step -> [Example] * data.train_batch_size``.

A row's prompt is a string, or a list of chat messages (verl's layout) rendered with the
model tokenizer's chat template (``add_generation_prompt=True``). Keys may name nested
fields with dots (``reward_model.ground_truth``). With ``data.answer_key`` unset the
ground truth is the row's ``answer``, else verl's ``reward_model.ground_truth``;
``data_source`` and ``extra_info`` are read when present and reach the reward.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .config import TrainerConfig
from .errors import RunError
from .rollout import Example
from .tasks import BUILTIN_TASKS, builtin_task

__all__ = ["load_data", "load_validation"]

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


def _reader(path: Path, key: str) -> list[tuple[str, Any]]:
    """``(where, row)`` for every row of the file (``where`` names it in errors)."""
    if path.suffix == ".jsonl":
        rows = []
        for number, raw in enumerate(path.read_bytes().splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise RunError(
                    f"{key}: {path} line {number} is not UTF-8 text (byte {err.start + 1}: "
                    f"{raw[err.start : err.start + 1]!r}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise RunError(f"{key}: {path} line {number} is not JSON: {err}") from None
        return rows
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise RunError(
                f"{key}: reading Parquet needs pyarrow: pip install 'rlwire-trainer[parquet]'"
            ) from None
        return [(f"row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist(), 1)]
    raise RunError(f"{key}: {path} must be .jsonl or .parquet")


class _Renderer:
    """Chat messages -> prompt text with the model's tokenizer (loaded on first use)."""

    def __init__(self, model_path: Path, source: Path, key: str) -> None:
        self.model_path, self.source, self.key = model_path, source, key
        self.tokenizer = None

    def __call__(self, messages: list, where: str) -> str:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
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


def _example(row: Any, where: str, config: TrainerConfig, render: _Renderer, path: Path, key: str):
    if not isinstance(row, Mapping):
        raise RunError(f"{key}: {path} {where} is not an object (a mapping of fields)")
    prompt_key = config.data.prompt_key
    prompt = _field(row, prompt_key)
    answer_keys = (config.data.answer_key,) if config.data.answer_key else _ANSWER_KEYS
    answer = next((v for k in answer_keys if (v := _field(row, k)) is not _MISSING), _MISSING)
    if prompt is _MISSING or answer is _MISSING:
        wanted = " or ".join(repr(k) for k in answer_keys)
        raise RunError(f"{key}: {path} {where} lacks {prompt_key!r} or {wanted}")
    if not isinstance(prompt, (str, list, tuple)):
        raise RunError(
            f"{key}: {path} {where}: {prompt_key!r} is a {type(prompt).__name__} "
            f"({prompt!r:.40}); use text or a list of chat messages"
        )
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise RunError(f"{key}: {path} {where}: {prompt_key!r} is empty")
    messages = None
    if isinstance(prompt, (list, tuple)):
        messages = [dict(m) for m in prompt]
        prompt = render(prompt, where)
    source = _field(row, "data_source")
    extra = _field(row, "extra_info")
    return Example(
        prompt=str(prompt),
        answer=str(answer),
        data_source="" if source is _MISSING else str(source),
        extra_info=dict(extra) if isinstance(extra, Mapping) else None,
        messages=messages,
    )


def _source(source: str, key: str):
    """The built-in task ``builtin:<name>`` names, or the data file ``source`` (named ``key``
    in the error when it is neither)."""
    task = builtin_task(source)
    if task is not None:
        return task
    path = Path(source)
    if not path.is_file():
        names = " or ".join(repr(f"builtin:{name}") for name in BUILTIN_TASKS)
        raise RunError(f"{key}: {source!r} is neither {names} nor a file")
    return path


def _task_examples(task, count: int, seed: int, source: str) -> list[Example]:
    return task.examples(count, seed, source)


def load_data(config: TrainerConfig, model_path: Path) -> Callable[[int], list[Example]]:
    """A function ``step -> [Example] * train_batch_size`` (deterministic in step); every row
    is read and checked now. ``model_path``: its tokenizer renders chat-message prompts."""
    size, seed = config.data.train_batch_size, config.trainer.seed
    source = config.data.source
    found = _source(source, "data.source")
    if not isinstance(found, Path):

        def generated(step: int) -> list[Example]:
            return _task_examples(found, size, seed * 1_000_003 + step, source)

        return generated
    rows = _file_rows(config, found, model_path, "data.source")

    def batch(step: int) -> list[Example]:
        start = step * size
        return [rows[(start + i) % len(rows)] for i in range(size)]

    return batch


def _file_rows(config: TrainerConfig, path: Path, model_path: Path, key: str) -> list[Example]:
    """Every row of the data file ``path`` (named ``key`` in errors), checked."""
    render = _Renderer(model_path, path, key)
    rows = [_example(row, where, config, render, path, key) for where, row in _reader(path, key)]
    if not rows:
        raise RunError(f"{key}: {path} holds no rows")
    return rows


def load_validation(config: TrainerConfig, model_path: Path) -> list[Example]:
    """The held-out prompts of ``validation.source``: every row of a file, or
    ``validation.prompts`` of a built-in task drawn apart from any training batch."""
    source = config.validation.source
    found = _source(source, "validation.source")
    if not isinstance(found, Path):  # training draws seed x 1_000_003 + step, step >= 0
        seed = config.trainer.seed * 1_000_003 - 1
        return _task_examples(found, config.validation.prompts, seed, source)
    return _file_rows(config, found, model_path, "validation.source")
