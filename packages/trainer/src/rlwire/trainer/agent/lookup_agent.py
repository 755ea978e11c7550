"""The built-in ``lookup`` task as an agent written only against the ``openai`` client
(``agent.function=rlwire.trainer.agent.lookup_agent:solve``): the same conversation as the
built-in loop with ``agent.tools=[rlwire.trainer.agent.lookup:lookup]`` (at most
``MAX_TURNS`` model turns, one tool call run per turn, a reply without one ends it, the
whole response within ``BUDGET`` tokens), scored by :func:`~.lookup.lookup_reward`.

What a user's agent looks like: it gets the row and a client, chats with tools, runs the
calls it is asked for (the tool reads the row's table of codes) and returns a reward; it
imports nothing of the trainer but its task's tool and reward.
"""

from __future__ import annotations

import json
from typing import Any

from .lookup import lookup, lookup_reward, row_table

__all__ = ["BUDGET", "MAX_TURNS", "TOOLS", "solve"]

MAX_TURNS = 3
BUDGET = 24
"""Response tokens per conversation, the tool's and template's included (the task's
``rollout.max_new_tokens``)."""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the code stored under a key.",
            "parameters": {
                "type": "object",
                "properties": {
                    "key": {"type": "string", "description": "three letters from a to j"}
                },
                "required": ["key"],
            },
        },
    }
]


def run_tool(call: Any, table: dict[str, str]) -> str:
    """A tool call's result as the model reads it (an error's message when it fails);
    ``table``: the row's codes."""
    try:
        arguments = json.loads(call.function.arguments)
        if call.function.name != "lookup":
            raise ValueError(f"unknown tool {call.function.name!r}")
        if set(arguments) != {"key"}:
            raise ValueError(f"lookup takes one argument, 'key'; got {sorted(arguments)}")
        return lookup(arguments["key"], table=table)
    except Exception as err:  # noqa: BLE001 - the model reads what went wrong
        return f"Error: {type(err).__name__}: {err}"


async def solve(row: dict[str, Any], client: Any) -> float:
    """One conversation of the lookup task through ``client``; its reward."""
    messages: list[dict[str, Any]] = list(row["prompt"])
    start, used, final = None, 0, ""
    for _ in range(MAX_TURNS):
        if used >= BUDGET:
            break
        answer = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=BUDGET - used
        )
        usage = answer.usage
        start = usage.prompt_tokens if start is None else start
        used = usage.prompt_tokens + usage.completion_tokens - start
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            final = message.content or ""
            break
        call = message.tool_calls[0]  # one call per turn, as agent.max_parallel_calls=1
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": run_tool(call, row_table(row))}
        )
    truth = row["reward_model"]["ground_truth"]
    return lookup_reward([""], [final], [truth])[0]
