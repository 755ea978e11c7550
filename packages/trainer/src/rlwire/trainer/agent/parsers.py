"""Tool calls in a model's text: the parser seam (``agent.format``) and the ``hermes``
format (Qwen's, and vLLM's and verl's ``hermes``):
``<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>``."""

from __future__ import annotations

import abc
import dataclasses
import json
import re
from typing import Any, ClassVar

from ..plugins import load_class

__all__ = ["TOOL_PARSERS", "HermesParser", "ParsedCall", "ToolCallParser", "parser_class"]

TOOL_PARSERS: dict[str, str] = {"hermes": "rlwire.trainer.agent.parsers:HermesParser"}


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call as written: its ``name`` and ``arguments``, or the ``error`` that made
    it unreadable (then the model gets the error as the call's result)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    text: str = ""
    """The call as the model wrote it."""


class ToolCallParser(abc.ABC):
    """Finds the tool calls in a model message (the text of its turn, special tokens
    removed)."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def parse(self, text: str) -> list[ParsedCall]:
        """Every call in ``text``, in order; a malformed one as a call with ``error`` set."""


class HermesParser(ToolCallParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks: the JSON an object with a string
    ``name`` and an object ``arguments`` (a JSON string holding one is accepted too, as
    vLLM's parser does). An opening tag that is never closed is a malformed call."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for match in self._BLOCK.finditer(text):
            body = match.group(1)
            if body is None:  # the second alternative: an opening tag to the end
                calls.append(_bad(match.group(0), "the <tool_call> is not closed"))
                continue
            calls.append(_read(body.strip(), match.group(0)))
        return calls


def _bad(text: str, error: str) -> ParsedCall:
    return ParsedCall(name="", arguments={}, error=error, text=text)


def _read(body: str, text: str) -> ParsedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return _bad(text, f"the tool call is not JSON: {err.msg} at character {err.pos}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return _bad(text, 'the tool call must be a JSON object with a string "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            return _bad(text, f'the "arguments" string is not JSON: {err.msg}')
    if not isinstance(arguments, dict):
        return ParsedCall(value["name"], {}, 'the "arguments" must be a JSON object', text=text)
    return ParsedCall(value["name"], arguments, text=text)


def parser_class(value: str) -> type[ToolCallParser]:
    """The parser for ``agent.format``: a name from :data:`TOOL_PARSERS` or a dotted path."""
    return load_class("agent.format", value, TOOL_PARSERS, ToolCallParser)
