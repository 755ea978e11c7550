"""The training data as a deterministic function ``step -> [Example] * data.train_batch_size``
(:class:`Batches`), and the held-out examples, from a resolved :class:`~.sources.Source`
(rows to examples: :mod:`.examples`). :func:`load_data` and :func:`load_validation` resolve
the source from the configuration themselves (the pipeline, :mod:`.pipeline`, once)."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..rollout import Example
from .examples import VALIDATION_STEP, RowRules, examples_of, task_examples
from .sources import Source, resolve_source

if TYPE_CHECKING:
    from ..config.root import TrainerConfig

__all__ = ["Batches", "batches_of", "epoch_order", "held_out", "load_data", "load_validation"]


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


def batches_of(source: Source, config: TrainerConfig, rules: RowRules, model_path: Path) -> Batches:
    """The training batches of ``source``; every row is read and checked now."""
    size, seed = config.data.train_batch_size, config.trainer.seed
    if source.task is not None:

        def generated(step: int) -> list[Example]:
            return task_examples(source, size, seed, step)

        return Batches(size, generated)
    examples = examples_of(source, rules, model_path, config.data.subset, config.data.split)
    order = epoch_order(len(examples), seed) if config.data.shuffle else None

    def batch(step: int) -> list[Example]:
        start = step * size  # positions run on through the epochs: the rows, epoch after epoch
        count = len(examples)
        if order is None:
            return [examples[(start + i) % count] for i in range(size)]
        return [examples[order((start + i) // count)[(start + i) % count]] for i in range(size)]

    return Batches(size, batch, examples)


def epoch_order(count: int, seed: int) -> Callable[[int], list[int]]:
    """``epoch -> the order its rows are walked in``: a permutation of ``range(count)``
    drawn from ``seed`` and the epoch alone (the last few kept), so that any step's batch
    is the same however the run got there. Picklable (fully async ships the batches to its
    sample queue's process)."""
    return _EpochOrder(count, seed)


@dataclasses.dataclass(frozen=True)
class _EpochOrder:
    count: int
    seed: int

    def __call__(self, epoch: int) -> list[int]:
        return _permutation(self.count, self.seed, epoch)


@functools.lru_cache(maxsize=4)
def _permutation(count: int, seed: int, epoch: int) -> list[int]:
    rows = list(range(count))
    random.Random(f"rlwire data order {seed} {epoch}").shuffle(rows)
    return rows


def held_out(
    source: Source, config: TrainerConfig, rules: RowRules, model_path: Path
) -> list[Example]:
    """The held-out examples of ``source``: every row of a file, dataset or given rows, or
    ``validation.prompts`` of a built-in task drawn apart from any training batch."""
    if source.task is not None:
        return task_examples(
            source, config.validation.prompts, config.trainer.seed, VALIDATION_STEP
        )
    return examples_of(source, rules, model_path, config.data.subset, config.validation.split)


def load_data(
    config: TrainerConfig,
    model_path: Path,
    *,
    rows: list[Mapping[str, Any]] | None = None,
    needs_answer: bool = True,
) -> Batches:
    """The training batches of ``data.source``, or of ``rows`` (the Python API's
    ``train_dataset``) in its place. ``model_path``: its tokenizer renders chat-message
    prompts; ``needs_answer``: whether a row must carry a ground truth."""
    source = resolve_source(config.data.source, "data.source", rows)
    return batches_of(source, config, RowRules.of(config, needs_answer=needs_answer), model_path)


def load_validation(
    config: TrainerConfig,
    model_path: Path,
    *,
    rows: list[Mapping[str, Any]] | None = None,
    needs_answer: bool = True,
) -> list[Example]:
    """The held-out examples of ``validation.source``, or of ``rows`` (the Python API's
    ``eval_dataset``) in its place."""
    spec = config.validation.source
    assert spec is not None or rows is not None, "validation.source: not set"
    source = resolve_source(spec or "eval_dataset", "validation.source", rows)
    return held_out(source, config, RowRules.of(config, needs_answer=needs_answer), model_path)
