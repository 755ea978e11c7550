"""The built-in tasks (``data.source=builtin:<name>``): their prompts, reward, model and the
settings a run of them starts from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..agent.lookup import as_example, build_lookup_model, lookup_examples, lookup_reward
from ..models.tiny import (
    build_tiny_model,
    count_prompts,
    count_reward,
    repeat_prompts,
    repeat_reward,
)
from ..rollout.common import Example

__all__ = ["BUILTIN_TASKS", "Task", "builtin_task"]


def _plain(prompt: str, answer: str, source: str) -> Example:
    return Example(prompt=prompt, answer=answer, data_source=source)


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """A built-in task: its prompts (``count, seed -> [(prompt, answer)]``), reward, how a
    pair becomes an :class:`Example`, the tiny model it trains (``model.path=tiny``: the
    builder and the directory's name) and the settings it starts from (``key=value``,
    under the run's own: a config file and the command line override them)."""

    prompts: Callable[..., list[tuple[str, str]]]
    reward: Callable[[list[str], list[str], list[str]], list[float]]
    example: Callable[[str, str, str], Example] = _plain
    build_model: Callable[..., Path] = build_tiny_model
    model_name: str = "tiny-model"
    defaults: tuple[str, ...] = ()

    def examples(self, count: int, seed: int, source: str) -> list[Example]:
        return [self.example(p, a, source) for p, a in self.prompts(count, seed=seed)]


BUILTIN_TASKS: dict[str, Task] = {
    "repeat": Task(repeat_prompts, repeat_reward),
    "count": Task(count_prompts, count_reward),
    "lookup": Task(
        lookup_examples,
        lookup_reward,
        as_example,
        build_lookup_model,
        "tiny-lookup-model",
        (
            "agent.enable=true",
            "agent.tools=[rlwire.trainer.agent.lookup:lookup]",
            "agent.max_assistant_turns=3",
            "rollout.max_new_tokens=24",
            "actor.optim.lr=5e-4",
            "trainer.steps=100",
        ),
    ),
}
"""``data.source=builtin:<name>``; ``reward.function=builtin`` is the task's reward."""


def builtin_task(source: str | list[str]) -> Task | None:
    """The task ``source`` names (``builtin:<name>``), or None (a list of files is none)."""
    if not isinstance(source, str) or not source.startswith("builtin:"):
        return None
    return BUILTIN_TASKS.get(source.removeprefix("builtin:"))
