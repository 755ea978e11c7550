"""The run's data, built once by the driver: :func:`build_pipeline` resolves the source, loads
the reward (whose signature says whether rows need a ground truth), builds and checks the
training and held-out examples, and turns ``trainer.total_epochs`` into steps. The modes
read the :class:`DataPipeline` it returns and never the data settings again."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RunError
from ..rollout import Example
from .dataset import Batches, batches_of, held_out
from .examples import RowRules, plain_prompt_note
from .rewards import Rewards, load_reward
from .sources import Source, resolve_source

if TYPE_CHECKING:
    from ..config.root import TrainerConfig

__all__ = ["DataPipeline", "build_pipeline"]

log = logging.getLogger("rlwire.trainer")


@dataclasses.dataclass(frozen=True, slots=True)
class DataPipeline:
    """What a run trains and validates on, and scores with."""

    source: Source
    batches: Batches
    """``step -> [Example] * data.train_batch_size``."""
    reward: Rewards
    validation: list[Example]
    """The held-out examples (none without ``validation.source``)."""
    steps: int
    """The steps to train: ``trainer.steps``, or ``trainer.total_epochs`` whole passes."""
    notes: tuple[str, ...] = ()
    """What the run is told once at start about its data (plain-text prompts to a model
    with a chat template)."""


def build_pipeline(
    config: TrainerConfig,
    model_path: Path,
    *,
    train_rows: Sequence[Mapping[str, Any]] | None = None,
    eval_rows: Sequence[Mapping[str, Any]] | None = None,
    reward_functions: Sequence[Callable[..., Any] | str] | None = None,
) -> DataPipeline:
    """The run's data from its configuration; the Python API's rows and reward functions in
    place of ``data.source``, ``validation.source`` and ``reward.function`` where given.
    Sets ``config.trainer.steps`` from ``trainer.total_epochs``. Raises RunError (one line)
    for a bad source, reward, row or epoch count, before anything starts."""
    source = resolve_source(config.data.source, "data.source", train_rows)
    reward = load_reward(config, reward_functions, task=source.task)  # its signature first
    rules = RowRules.of(config, needs_answer=reward.needs_answer())
    batches = batches_of(source, config, rules, model_path)
    validation: list[Example] = []
    if config.validation.source is not None or eval_rows is not None:
        spec = config.validation.source or "eval_dataset"
        held = resolve_source(spec, "validation.source", eval_rows)
        validation = held_out(held, config, rules, model_path)
    if not config.agent.scores:  # the reward function scores every row: can it?
        label = f"data.source {config.data.source!r}"
        if validation:
            label += f" with validation.source {config.validation.source!r}"
        reward.check_rows([*(batches.rows or []), *validation], label)
    steps = _steps(config, batches)
    config.trainer.steps = steps
    note = plain_prompt_note(batches.rows, model_path) if batches.rows else None
    return DataPipeline(source, batches, reward, validation, steps, (note,) if note else ())


def _steps(config: TrainerConfig, batches: Batches) -> int:
    """``trainer.steps``, or ``trainer.total_epochs`` in steps now that the rows are counted."""
    epochs = config.trainer.total_epochs
    if epochs is None:
        return config.trainer.steps
    per_epoch = batches.epoch_steps()
    if per_epoch is None:
        raise RunError(
            f"trainer.total_epochs={epochs}: data.source {config.data.source!r} is a built-in "
            "task, which has no epochs; set trainer.steps instead"
        )
    if per_epoch == 0:
        raise RunError(
            f"trainer.total_epochs={epochs}: the data has {len(batches.rows or ())} rows, "
            f"fewer than one batch (data.train_batch_size={config.data.train_batch_size}); "
            "lower it"
        )
    log.info(
        "trainer.total_epochs=%d: %d steps of %d prompts",
        epochs,
        epochs * per_epoch,
        config.data.train_batch_size,
    )
    return epochs * per_epoch
