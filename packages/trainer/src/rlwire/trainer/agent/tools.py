"""Tools: plain Python functions (sync or async) named by dotted path, their JSON schema from
the type hints and docstring (transformers' ``get_json_schema``, as TRL and chat templates
use), and running calls with a timeout each, concurrently, never raising: a call that
fails in any way is an error message for the model.

**Arguments from the data row.** A tool's keyword-only parameters (after ``*``) are not the
model's to give: they are left out of its schema and filled from the row, from verl's
``extra_info.tools_kwargs.<tool name>.create_kwargs`` (:func:`row_arguments`). A row's
answer key for its tool (the lookup task's table of codes) reaches the tool this way, and
the model cannot set it: a call that names it is refused as an unknown argument."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import time
from collections.abc import Callable
from typing import Any

from ..checks import ConfigError
from .calls import Call
from .parsers import ParsedCall

__all__ = ["Tool", "ToolResult", "ToolRunner", "check_arguments", "load_tools", "row_arguments"]


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    """A tool: its ``name`` (the function's), the function and its JSON schema
    (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    bound: tuple[str, ...] = ()
    """Its keyword-only parameters: filled from the data row, not in ``schema``."""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


@dataclasses.dataclass(slots=True)
class ToolResult:
    """One call's outcome: the text the model gets back, and ``error`` when the call failed
    (the text is then the error message)."""

    name: str
    arguments: dict[str, Any]
    text: str
    error: str | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_tools(specs: list[str]) -> list[Tool]:
    """The tools ``agent.tools`` names (``package.module:function``), each imported and its
    schema built now; a bad path, a non-callable or a function without the hints and
    docstring a schema needs stops with ``ConfigError`` naming it."""
    from transformers.utils import get_json_schema

    tools, names = [], set()
    for spec in specs:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(
                f"agent.tools: {spec!r} is not allowed; use a dotted path 'package.module:function'"
            )
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"agent.tools: cannot import {spec!r}: {err}") from None
        if not callable(fn):
            raise ConfigError(f"agent.tools: {spec!r} is not callable")
        try:
            schema = get_json_schema(fn)
        except (
            Exception
        ) as err:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(
                f"agent.tools: {spec!r} has no JSON schema: {err} (a tool needs type hints on "
                "every argument and a docstring with an Args section describing each)"
            ) from None
        bound = _row_parameters(fn)
        parameters = schema["function"].get("parameters", {})
        for key in bound:
            parameters.get("properties", {}).pop(key, None)
        if "required" in parameters:
            parameters["required"] = [k for k in parameters["required"] if k not in bound]
        name = schema["function"]["name"]
        if name in names:
            raise ConfigError(f"agent.tools: two tools are named {name!r}")
        names.add(name)
        tools.append(Tool(name, fn, schema, bound))
    return tools


def _row_parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to bind
        return ()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def row_arguments(extra_info: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each tool's arguments from a data row's ``extra_info`` (verl's
    ``tools_kwargs.<tool name>.create_kwargs``), by tool name; none where it has none."""
    given = (extra_info or {}).get("tools_kwargs") or {}
    if not isinstance(given, dict):
        return {}
    out = {}
    for name, entry in given.items():
        kwargs = entry.get("create_kwargs") if isinstance(entry, dict) else None
        if isinstance(kwargs, dict):
            out[str(name)] = dict(kwargs)
    return out


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _matches(value: Any, spec: dict[str, Any]) -> bool:
    kinds = spec.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in kinds:
        allowed = _JSON_TYPES.get(kind, (object,))
        if isinstance(value, bool) and kind in ("integer", "number"):
            continue  # JSON's true is not a number
        if isinstance(value, allowed):
            return "enum" not in spec or value in spec["enum"]
    return False


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for ``tool``'s schema (required, unknown and
    wrongly typed arguments), or None."""
    parameters = tool.schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    problems = [f"missing {k!r}" for k in parameters.get("required", []) if k not in arguments]
    for key, value in arguments.items():
        if key not in properties:
            problems.append(f"unknown argument {key!r} (it takes {sorted(properties)})")
        elif not _matches(value, properties[key]):
            problems.append(f"{key!r} must be {properties[key].get('type')}, got {value!r}")
    return "; ".join(problems) or None


class ToolRunner:
    """Runs tool calls concurrently, each within ``timeout`` seconds and each in a thread of
    its own (:class:`~rlwire.trainer.agent.calls.Call`; an async tool in an event loop of
    its own there, so that one that blocks holds back no other); a call past its time is
    stopped and answered with an error."""

    def __init__(self, tools: list[Tool], timeout: float, max_chars: int) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout, self.max_chars = timeout, max_chars

    def run(
        self, calls: list[ParsedCall], row: dict[str, dict[str, Any]] | None = None
    ) -> list[ToolResult]:
        """Every call's result, in order; all start at once. ``row``: each tool's arguments
        from the data row (:func:`row_arguments`), given to its keyword-only parameters."""
        started = [self._start(call, row or {}) for call in calls]
        return [finish() for finish in started]

    def _start(self, call: ParsedCall, row: dict[str, dict[str, Any]]) -> Callable[[], ToolResult]:
        began = time.perf_counter()

        def failed(error: str) -> Callable[[], ToolResult]:
            result = ToolResult(call.name, call.arguments, f"Error: {error}", error, 0.0)
            return lambda: result

        if call.error is not None:
            return failed(call.error)
        tool = self.tools.get(call.name)
        if tool is None:
            return failed(
                f"no tool named {call.name!r}; the tools are {sorted(self.tools) or 'none'}"
            )
        problem = check_arguments(tool, call.arguments)
        if problem is not None:
            return failed(f"bad arguments for {call.name!r}: {problem}")
        hidden = {k: v for k, v in row.get(tool.name, {}).items() if k in tool.bound}
        running = Call(tool.fn, name=f"tool-{tool.name}", **call.arguments, **hidden)

        def finish() -> ToolResult:
            answered = running.wait(self._left(began))
            seconds = time.perf_counter() - began
            if not answered:
                running.stop()
                error = f"{call.name!r} did not answer within {self.timeout:g} s"
            elif running.error is not None:
                err = running.error
                error = f"{call.name!r} raised {type(err).__name__}: {err}"
            elif not isinstance(running.value, str):
                error = f"{call.name!r} returned {type(running.value).__name__}, not text"
            else:
                text = self._cut(running.value)
                return ToolResult(call.name, call.arguments, text, None, seconds)
            return ToolResult(call.name, call.arguments, f"Error: {error}", error, seconds)

        return finish

    def _left(self, began: float) -> float:
        return max(0.0, began + self.timeout - time.perf_counter())

    def _cut(self, text: str) -> str:
        """At most ``max_chars`` characters: the middle cut out (verl's default side)."""
        if len(text) <= self.max_chars:
            return text
        half = self.max_chars // 2
        return text[:half] + "..." + text[len(text) - (self.max_chars - half) :]
