"""What one trajectory recorded besides its tokens: its turns, tool calls and rewards (for
the metrics and ``trainer.rollout_data_dir``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .tools import ToolResult

__all__ = ["Trajectory", "Turn"]


@dataclasses.dataclass(slots=True)
class Turn:
    """One turn: its ``role`` (``assistant`` for the model's, else the environment
    message's), the response positions ``[start, end)`` its tokens take, its text."""

    role: str
    start: int
    end: int
    text: str


@dataclasses.dataclass(slots=True)
class Trajectory:
    """One conversation's record, beside its row of the :class:`~rlwire.trainer.rollout.Rollout`."""

    turns: list[Turn] = dataclasses.field(default_factory=list)
    tool_results: list[ToolResult] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    """The environment's reward for each of its turns (an :class:`Environment` subclass's;
    the tools' environment gives none)."""
    stop: str = ""
    """Why it ended: ``no_call`` / ``done`` (the environment's), ``length``
    (``rollout.max_new_tokens``), ``max_assistant_turns``, ``max_user_turns`` or ``error``
    (the environment failed: ``error`` says how); ``agent.function``'s: ``agent_returned``
    or ``agent_failed`` (``error`` says how)."""
    dropped_calls: int = 0
    error: str | None = None
    calls: int = 0
    """``agent.function``: the session's calls to the model through the endpoint."""
    breaks: int = 0
    """``agent.function``: calls whose prompt did not extend the sequence before it."""
    extras: dict[str, float] = dataclasses.field(default_factory=dict)
    """``agent.function``: the numeric extras the agent returned beside its reward."""

    @property
    def assistant_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(r.error is not None for r in self.tool_results) + (self.error is not None)

    @property
    def tool_seconds(self) -> float:
        return sum(r.seconds for r in self.tool_results)

    def to_json(self) -> dict[str, Any]:
        return {
            "turns": [dataclasses.asdict(t) for t in self.turns],
            "tool_calls": [r.to_json() for r in self.tool_results],
            "turn_rewards": list(self.rewards),
            "stop": self.stop,
            "dropped_calls": self.dropped_calls,
            "error": self.error,
            "model_calls": self.calls,
            "breaks": self.breaks,
            "extras": dict(self.extras),
        }


def trajectory_metrics(trajectories: list[Trajectory], lengths: list[int]) -> dict[str, float]:
    """A batch's multi-turn metrics (``metrics.jsonl``): ``turns_mean`` and
    ``tool_calls_mean`` (model turns and tool calls per trajectory), ``tool_errors`` and
    ``tool_calls_dropped`` (counts in the batch), ``tool_time_s`` (mean seconds per call)
    and ``trajectory_length`` (mean response tokens, the environment's and template's
    included; ``lengths`` each one's); with ``agent.function``, ``model_calls_mean``,
    ``agent_breaks`` and ``agent_failures`` (counts in the batch)."""
    calls = [r for t in trajectories for r in t.tool_results]
    sessions = [t for t in trajectories if t.stop.startswith("agent_")]
    if sessions:
        return {
            "model_calls_mean": sum(t.calls for t in sessions) / len(sessions),
            "agent_breaks": float(sum(t.breaks for t in sessions)),
            "agent_failures": float(sum(t.stop == "agent_failed" for t in sessions)),
            "trajectory_length": sum(lengths) / len(lengths),
        }
    return {
        "turns_mean": sum(t.assistant_turns for t in trajectories) / len(trajectories),
        "tool_calls_mean": len(calls) / len(trajectories),
        "tool_errors": float(sum(t.tool_errors for t in trajectories)),
        "tool_calls_dropped": float(sum(t.dropped_calls for t in trajectories)),
        "tool_time_s": sum(r.seconds for r in calls) / len(calls) if calls else 0.0,
        "trajectory_length": sum(lengths) / len(lengths),
    }
