"""What the agent endpoint (:mod:`.endpoint`) reads from a call's body before anything else
sees it: the bytes (at most :data:`MAX_BODY_BYTES`), the JSON object they hold, and the call
it asks for (:class:`ChatCall` for ``/v1/chat/completions``, :class:`CompletionCall` for
``/v1/completions``), its prompt's token ids checked against the model.

Every function here returns what the body says or raises :class:`Refused` (the HTTP status,
400 or 413, and a message naming the field); never another exception, whatever the bytes
(the fuzzer: ``packages/trainer/tests/test_trainer_fuzz.py``). A body is untrusted even
behind a session's key: an agent is a user's program.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_DEPTH",
    "ChatCall",
    "CompletionCall",
    "Refused",
    "chat_call",
    "check_length",
    "check_prompt",
    "completion_call",
    "max_tokens",
    "parse_json",
    "too_large",
]

MAX_BODY_BYTES = 16 << 20
"""Bytes a call's body may hold (16 MiB: a conversation of about a million tokens' text);
a longer one is refused with 413 before it is read."""
MAX_DEPTH = 64
"""Levels of nesting a body may hold (an OpenAI call's deepest, a tool's JSON schema, holds
about ten): comparing or rendering a deeper one would run out of stack."""


class Refused(Exception):
    """A call the endpoint answers with ``status`` and ``message`` (OpenAI's error shape)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclasses.dataclass(frozen=True, slots=True)
class ChatCall:
    """A chat call: its messages as sent, the schemas of its tools (each tool's
    ``function``, or the tool itself where it has none) and the tokens it asks for at most
    (None: the run's ``rollout.max_new_tokens``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    max_tokens: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionCall:
    """A completion call: its prompt (text, or token ids) and the tokens it asks for at
    most (None: the run's)."""

    prompt: str | list[int]
    max_tokens: int | None


def too_large(limit: int) -> Refused:
    """The refusal of a body over ``limit`` bytes."""
    return Refused(413, f"the body is over {limit} bytes, the endpoint's limit (MAX_BODY_BYTES)")


def check_length(declared: str | None, limit: int) -> None:
    """Refuse a body whose ``Content-Length`` says it is over ``limit`` bytes, before any
    of it is read (a body sent without one is counted as it arrives: :func:`too_large`)."""
    if declared is None:
        return
    declared = declared.strip(" \t")  # HTTP's optional white space only
    if not (declared.isascii() and declared.isdigit()):
        raise Refused(400, f"Content-Length: {_shown(declared)} is not a number of bytes")
    if int(declared) > limit:
        raise too_large(limit)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object ``raw`` holds, nested at most :data:`MAX_DEPTH` levels."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise Refused(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    _check_depth(body)
    return body


def _check_depth(body: dict[str, Any]) -> None:
    level: list[Any] = [body]
    for _ in range(MAX_DEPTH):
        level = [
            inner
            for value in level
            for inner in (value.values() if isinstance(value, dict) else value)
            if isinstance(inner, dict | list)
        ]
        if not level:
            return
    raise Refused(400, f"the body is nested deeper than {MAX_DEPTH} levels")


def max_tokens(body: Mapping[str, Any]) -> int | None:
    """``max_completion_tokens``, else ``max_tokens``: an int >= 1, or None (not given)."""
    asked = body.get("max_completion_tokens")
    if asked is None:
        asked = body.get("max_tokens")
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise Refused(400, f"max_tokens: {_shown(asked)}; use an int >= 1")
    return asked


def chat_call(body: Mapping[str, Any]) -> ChatCall:
    """The chat call ``body`` asks for: messages in OpenAI's shape (a role; content a
    string, null or a list of content parts; tool calls each a ``function`` with a name and
    arguments as a string or an object), tools each with a named schema."""
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        raise Refused(400, "messages: use a non-empty list of message objects")
    for i, message in enumerate(messages):
        _check_message(f"messages[{i}]", message)
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise Refused(400, "tools: use a list of tool objects")
    schemas = []
    for i, tool in enumerate(tools):
        schema = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise Refused(
                400, f'tools[{i}]: use {{"type": "function", "function": {{"name": ...}}}}'
            )
        schemas.append(schema)
    return ChatCall(messages, schemas, max_tokens(body))


def _check_message(where: str, message: dict[str, Any]) -> None:
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise Refused(400, f"{where}.role: {_shown(role)}; use a string (user, assistant, ...)")
    content = message.get("content")
    if not (
        content is None
        or isinstance(content, str)
        or (isinstance(content, list) and all(isinstance(p, dict) for p in content))
    ):
        raise Refused(400, f"{where}.content: use a string, null or a list of content parts")
    for key in ("name", "tool_call_id"):
        if not isinstance(message.get(key), str | None):
            raise Refused(400, f"{where}.{key}: use a string")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise Refused(400, f"{where}.tool_calls: use a list of tool calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str | dict)
        ):
            raise Refused(
                400,
                f'{where}.tool_calls[{j}]: use {{"function": {{"name": ..., "arguments": '
                "...}} with arguments a JSON string or object",
            )


def completion_call(body: Mapping[str, Any]) -> CompletionCall:
    """The completion call ``body`` asks for: one prompt, text or token ids (a list of
    ints; whether the model has them: :func:`check_prompt`)."""
    prompt = body.get("prompt")
    if not (
        isinstance(prompt, str)
        or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    ):
        raise Refused(400, "prompt: use a string or a list of token ids")
    return CompletionCall(prompt, max_tokens(body))


def check_prompt(prompt: list[int], *, vocabulary: int, context: int | None) -> int | None:
    """Refuse a prompt the engine must not see: empty, an id outside the vocabulary (one
    session's bad call never reaches a batch it shares with others: a device-side assert
    on CUDA), or one that leaves the model's ``context`` no room for a token of answer.
    The tokens left in the context (None: unknown)."""
    if not prompt:
        raise Refused(400, "the prompt is empty")
    bad = next((t for t in prompt if isinstance(t, bool) or not 0 <= t < vocabulary), None)
    if bad is not None:
        raise Refused(
            400,
            f"prompt: token id {_shown(bad)} is outside the vocabulary (0 to {vocabulary - 1})",
        )
    room = None if context is None else context - len(prompt)
    if room is not None and room < 1:
        raise Refused(
            400,
            f"prompt: {len(prompt)} tokens; the model's context is {context}, which must "
            "leave room for at least one token of answer",
        )
    return room


def _shown(value: Any, most: int = 60) -> str:
    """``repr(value)``, cut to ``most`` characters: a message never carries a whole body."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<an int of {value.bit_length()} bits>"
    return text if len(text) <= most else text[: most - 3] + "..."
