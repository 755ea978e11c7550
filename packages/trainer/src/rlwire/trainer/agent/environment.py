"""Environments: what answers a model's turn. A stateful task is an :class:`Environment`
subclass named by ``agent.environment`` (one instance per trajectory); without one, the
:class:`ToolEnvironment` runs the tool calls it finds in each message."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from ..plugins import load_class
from ..rollout.common import Example
from .parsers import ToolCallParser
from .tools import ToolResult, ToolRunner, row_arguments

__all__ = ["Environment", "Observation", "ToolEnvironment", "environment_class"]


@dataclasses.dataclass(slots=True)
class Observation:
    """What the environment answers a model message with: ``messages`` (chat messages to
    append: role ``tool`` for tool results, ``user`` for anything else; none when it is
    done), a ``reward`` for this turn and whether the trajectory is ``done``."""

    messages: list[dict[str, Any]]
    reward: float = 0.0
    done: bool = False
    tool_results: list[ToolResult] = dataclasses.field(default_factory=list)
    dropped_calls: int = 0


class Environment(abc.ABC):
    """One trajectory's task: :meth:`reset` from its data row, then :meth:`step` with each
    model message until it says ``done``. Built with no arguments, one per trajectory;
    :meth:`step` runs in a thread of its own (the trajectories of a batch step at once)
    and is bounded by ``agent.tool_timeout``."""

    def reset(self, example: Example) -> None:  # noqa: B027 - optional for a stateless task
        """Start from the data row ``example`` (its prompt, ``answer``, ``extra_info``)."""

    @abc.abstractmethod
    def step(self, message: str) -> Observation | tuple[Any, float, bool]:
        """Answer the model's ``message`` (its turn's text, special tokens removed): an
        :class:`Observation`, or ``(observation, reward, done)`` with ``observation`` a
        user message's text, a list of chat messages, or None."""


def as_observation(value: Observation | tuple[Any, float, bool]) -> Observation:
    """An environment's answer as an :class:`Observation`; ``TypeError`` naming what is wrong."""
    if isinstance(value, Observation):
        return value
    if not (isinstance(value, tuple) and len(value) == 3):
        raise TypeError(
            f"step returned {type(value).__name__}; return an Observation or "
            "(observation, reward, done)"
        )
    observation, reward, done = value
    if observation is None:
        messages = []
    elif isinstance(observation, str):
        messages = [{"role": "user", "content": observation}]
    elif isinstance(observation, list) and all(
        isinstance(m, dict) and "role" in m for m in observation
    ):
        messages = list(observation)
    else:
        raise TypeError(
            f"step's observation is {type(observation).__name__}; use text, a list of chat "
            "messages (dicts with 'role' and 'content') or None"
        )
    return Observation(messages, float(reward), bool(done))


class ToolEnvironment(Environment):
    """The tools' environment: the calls in a message are run (at most
    ``agent.max_parallel_calls``, the rest dropped and counted; each tool's keyword-only
    parameters from the row) and their results become ``tool`` messages; a message without
    a call ends the trajectory."""

    def __init__(self, runner: ToolRunner, parser: ToolCallParser, max_calls: int) -> None:
        self.runner, self.parser, self.max_calls = runner, parser, max_calls
        self.row: dict[str, dict[str, Any]] = {}

    def reset(self, example: Example) -> None:
        """Keep the row's arguments for the tools (:func:`~.tools.row_arguments`)."""
        self.row = row_arguments(example.extra_info)

    def step(self, message: str) -> Observation:
        calls = self.parser.parse(message)
        if not calls:  # the model answered: the trajectory ends (``no_call``)
            return Observation([])
        results = self.runner.run(calls[: self.max_calls], self.row)
        messages = [{"role": "tool", "name": r.name, "content": r.text} for r in results]
        return Observation(
            messages,
            tool_results=results,
            dropped_calls=max(0, len(calls) - self.max_calls),
        )


def environment_class(value: str) -> type[Environment]:
    """The class ``agent.environment`` names (a dotted path ``package.module:Class``)."""
    return load_class("agent.environment", value, {}, Environment)
