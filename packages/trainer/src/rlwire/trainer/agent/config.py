"""The ``agent`` section: multi-turn rollouts with tools or an environment (verl's
``actor_rollout_ref.rollout.multi_turn.*`` where it has the same key)."""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress

from ..checks import ConfigError, check, check_engine
from ..rollout.base import rollout_engine_class
from .environment import environment_class
from .parsers import TOOL_PARSERS, parser_class
from .tools import load_tools

__all__ = ["AgentConfig", "check_agent", "endpoint_warnings"]


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentConfig:
    enable: bool = False
    """Multi-turn rollouts: after each model turn, the tools (or ``environment``) answer
    and the model continues, until a turn without a tool call, a turn limit, the
    environment's ``done`` or ``rollout.max_new_tokens`` (the whole response: model,
    tool and template tokens, as verl's ``response_length``). On automatically with
    ``data.source=builtin:lookup``."""
    tools: list[str] = dataclasses.field(default_factory=list)
    """Tools as dotted paths ``package.module:function`` (plain Python functions, sync or
    async; type hints and a Google-style docstring give the JSON schema through
    transformers' ``get_json_schema``). A tool's keyword-only parameters are not in its
    schema: they come from the data row's ``extra_info.tools_kwargs.<tool
    name>.create_kwargs`` (verl's key). The ``lookup`` task's:
    ``rlwire.trainer.agent.lookup:lookup``."""
    environment: str | None = None
    """A stateful task as a dotted path ``package.module:Class`` to a
    ``rlwire.trainer.agent.Environment`` subclass, one instance per trajectory (reset
    from the data row, stepped with each model message). None: the tools' environment
    (tool calls parsed from the message and run; a message without one ends the
    trajectory)."""
    format: str = "hermes"
    """How tool calls are written in the model's text: ``hermes`` (``<tool_call>{"name":
    ..., "arguments": ...}</tool_call>``, Qwen's and vLLM's and verl's ``hermes``), or a
    dotted path to a ``rlwire.trainer.agent.ToolCallParser`` subclass."""
    max_assistant_turns: int | None = None
    """Model turns per trajectory at most (None: until another limit ends it)."""
    max_user_turns: int | None = None
    """Environment turns (tool results or environment messages) at most (None: no limit)."""
    max_parallel_calls: int = 1
    """Tool calls run per model turn; further calls in the same message are dropped and
    counted (``tool_calls_dropped``), as verl does."""
    tool_timeout: float = 30.0
    """Seconds one tool call may take; past it the model gets an error message as the
    result (counted in ``tool_errors``) and the trajectory goes on."""
    max_tool_response_length: int = 256
    """Characters of a tool's result kept (the middle is cut, as verl's default
    ``tool_response_truncate_side=middle``)."""
    function: str | None = None
    """An agent written against the OpenAI client, as a dotted path
    ``package.module:function`` to ``async def agent(row, client)``: called once per
    conversation with the data row (verl's keys: ``prompt`` as chat messages,
    ``data_source``, ``reward_model.ground_truth``, ``extra_info``) and an
    ``openai.AsyncOpenAI`` client already set to this run's endpoint and a session of its
    own; it calls the model as often as it likes and returns the reward (a number) or a
    dict with ``reward`` and numeric extras. What the policy sampled in its calls is the
    training sample, token for token. Needs the ``openai`` extra; turns multi-turn
    rollouts on, without ``tools`` or ``environment`` (the agent runs its own)."""
    timeout: float = 600.0
    """Seconds one ``agent.function`` session may take; past it the agent is stopped and the
    session counts as failed (see ``failure``)."""
    failure: str = "zero"
    """What a failed ``agent.function`` session (it raised, returned no finite reward, made
    no call to the model, or ran past ``timeout``) gives: ``zero`` (reward 0; its sampled
    tokens are trained on as a wrong answer's) or ``drop`` (its prompt group is replaced by
    the next prompt's, as ``algorithm.filter_groups`` replaces a group). Counted
    (``agent_failures`` with ``zero``, ``filtered_groups`` with ``drop``) and named in the
    rollout worker's log either way."""
    max_failed_steps: int = 3
    """Steps in a row in which every session failed before the model answered (nothing to
    train on: each such step is skipped, ``update_skipped`` in its metrics line) before the
    run stops with one line naming the agent and its last error."""
    endpoint_host: str = "127.0.0.1"
    """Where each rollout worker's OpenAI-compatible endpoint listens (``agent.function``):
    loopback, for agents in the worker's process; every call needs its session's key.
    Another address (``0.0.0.0``: every interface) is warned about once at start: the
    endpoint is then reachable from other machines."""

    def __post_init__(self) -> None:
        check_engine(self.format, "agent.format", TOOL_PARSERS, parser_class)
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"agent.{key}", value, "use an int >= 1 or null")
        check(
            self.max_parallel_calls >= 1,
            "agent.max_parallel_calls",
            self.max_parallel_calls,
            "use an int >= 1",
        )
        check(self.tool_timeout > 0, "agent.tool_timeout", self.tool_timeout, "use seconds > 0")
        check(
            self.max_tool_response_length >= 1,
            "agent.max_tool_response_length",
            self.max_tool_response_length,
            "use an int >= 1",
        )
        if not isinstance(self.tools, list) or not all(isinstance(t, str) for t in self.tools):
            raise ConfigError(
                f"agent.tools: {self.tools!r} is not allowed; use a list of dotted paths "
                "'package.module:function'"
            )
        check(self.timeout > 0, "agent.timeout", self.timeout, "use seconds > 0")
        check(
            self.max_failed_steps >= 1,
            "agent.max_failed_steps",
            self.max_failed_steps,
            "use an int >= 1",
        )
        check(self.failure in ("zero", "drop"), "agent.failure", self.failure, "use zero or drop")
        if self.function is not None:
            self._check_function(self.function)
            self.enable = True
        if self.enable or self.tools or self.environment:
            # imported now, so that a bad path fails at config load, not in a worker
            load_tools(self.tools)
            if self.environment is not None:
                self._check_environment(self.environment)

    @property
    def scores(self) -> bool:
        """Whether the agent scores its own sessions (``function`` returns each reward, an
        ``environment`` gives step rewards): ``reward.function`` is then not called."""
        return self.function is not None or self.environment is not None

    def _check_function(self, value: str) -> None:
        from .function import load_agent_function

        if self.tools or self.environment is not None:
            raise ConfigError(
                f"agent.function: {value!r} runs its own tools; leave agent.tools and "
                "agent.environment unset with it"
            )
        try:
            load_agent_function(value)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for module in ("openai", "fastapi", "uvicorn"):
            if importlib.util.find_spec(module) is None:
                from .endpoint import INSTALL_HINT

                raise ConfigError(f"agent.function: {INSTALL_HINT} ({module} is missing)")

    @staticmethod
    def _check_environment(value: str) -> None:
        check(
            ":" in value,
            "agent.environment",
            value,
            "use a dotted path 'package.module:Class' to a rlwire.trainer.agent.Environment "
            "subclass",
        )
        try:
            environment_class(value)
        except ValueError as err:  # not an Environment subclass: the message names the key
            raise ConfigError(str(err)) from None
        except ImportError as err:
            raise ConfigError(f"agent.environment: cannot import {value!r}: {err}") from None


def endpoint_warnings(agent: AgentConfig) -> list[str]:
    """What a run is warned about once at start (:func:`~rlwire.trainer.driver.
    run_warnings`): an agent endpoint listening beyond loopback."""
    host = agent.endpoint_host
    if agent.function is None or _loopback(host):
        return []
    return [
        f"agent.endpoint_host={host}: each rollout worker's agent endpoint listens beyond "
        f"this machine, reachable by whoever can reach {host}; every call needs a session's "
        "key, but keep it on loopback (127.0.0.1, the default) unless agents call it from "
        "other machines"
    ]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def check_agent(config) -> None:
    """What multi-turn rollouts need of the rest of the
    :class:`~rlwire.trainer.config.root.TrainerConfig`: an engine that takes token-id
    requests (``submit``), and validation at the training temperature."""
    rollout = config.rollout
    check(
        rollout_engine_class(rollout.backend).serves_requests
        or rollout_engine_class(rollout.backend).can_continue,
        "agent.enable",
        True,
        f"rollout.backend {rollout.backend!r} takes no token-id requests (neither "
        "serves_requests nor a rlwire.trainer.rollout.PartialRolloutEngine); use 'hf' or "
        "'vllm'",
    )
    val = config.validation
    if val.source is not None:
        check(
            val.do_sample and val.temperature == rollout.temperature,
            "validation.do_sample",
            val.do_sample,
            "multi-turn rollouts sample at rollout.temperature: set validation.do_sample="
            f"true and validation.temperature={rollout.temperature}",
        )
