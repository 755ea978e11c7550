"""Agentic rollouts: multi-turn conversations with tools or an environment, token in and
token out (``agent.*``, verl's ``actor_rollout_ref.rollout.multi_turn.*``).

Lives here: the section (:mod:`.config`), the tool-call parsers (:mod:`.parsers`), tools
(:mod:`.tools`), environments (:mod:`.environment`), the chat-template seams between
turns (:mod:`.render`), what a trajectory recorded (:mod:`.trajectory`), the loop on a
rollout engine (:mod:`.loop`), the built-in ``lookup`` task (:mod:`.lookup`), and the
OpenAI-compatible endpoint for agents written against the OpenAI client (:mod:`.endpoint`,
FastAPI and uvicorn imported when it starts) with the sessions it records
(:mod:`.sessions`). May import ``rollout``, ``models`` and the foundation (``checks``,
``errors``, ``plugins``); never the job, the workers or Ray.
"""

from __future__ import annotations

from .config import AgentConfig
from .environment import Environment, Observation, ToolEnvironment
from .parsers import TOOL_PARSERS, HermesParser, ParsedCall, ToolCallParser
from .tools import Tool, ToolResult, load_tools

__all__ = [
    "TOOL_PARSERS",
    "AgentConfig",
    "Environment",
    "HermesParser",
    "Observation",
    "ParsedCall",
    "Tool",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolResult",
    "load_tools",
]
