"""Test helper (not a test module): tools and environments named by dotted path in the agent
tests, as a user's module would hold them."""

from __future__ import annotations

import asyncio
import threading
import time

from rlwire.trainer.agent import Environment, Observation


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)


async def slow_echo(text: str, seconds: float) -> str:
    """Echo some text after a while.

    Args:
        text: what to echo.
        seconds: how long to wait first.
    """
    await asyncio.sleep(seconds)
    return text


def hang(seconds: float) -> str:
    """Block the calling thread.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke"


def spin(seconds: float) -> str:
    """Keep the CPU busy in Python code (a tool stuck in a loop).

    Args:
        seconds: how long.
    """
    end, laps = time.monotonic() + seconds, 0
    while time.monotonic() < end:  # Python bytecode: what a stopped call's exception stops
        laps += 1
    return f"spun {laps} laps"


_RELEASED = threading.Event()


async def hold(seconds: float) -> str:
    """Block the calling thread (not an await) until ``release`` runs.

    Args:
        seconds: how long at most.
    """
    released = _RELEASED.wait(seconds)
    _RELEASED.clear()
    return "released" if released else "never released"


async def release() -> str:
    """Let ``hold`` go on."""
    _RELEASED.set()
    return "done"


def broken(x: str) -> str:
    """Always fail.

    Args:
        x: anything.
    """
    raise KeyError(x)


def not_text(x: str) -> str:
    """Return a number where text is promised.

    Args:
        x: anything.
    """
    return 42  # type: ignore[return-value]


class Countdown(Environment):
    """Answers each model message with ``left: N`` (a user turn) and a reward of 0.25, and is
    done after three model messages."""

    def reset(self, example) -> None:
        self.left = 3

    def step(self, message: str):
        self.left -= 1
        return (None if self.left == 0 else f"left {self.left}"), 0.25, self.left == 0


class Raises(Environment):
    def step(self, message: str) -> Observation:
        raise RuntimeError("the sandbox is gone")


def undocumented(x):  # no type hints and no docstring: no schema
    return x


def stall(key: str) -> str:
    """Never answer in time.

    Args:
        key: anything.
    """
    time.sleep(60)
    return key


class Rendezvous(Environment):
    """Two conversations, ``x`` and ``y``: x's first step waits (blocking its thread) until y's
    second step has run; y goes on after its first. Rewards: 1.0 for a step that saw the
    other conversation get there."""

    second = threading.Event()

    @classmethod
    def reset_all(cls) -> None:
        cls.second.clear()

    def reset(self, example) -> None:
        self.name, self.steps = example.prompt, 0

    def step(self, message: str):
        self.steps += 1
        if self.name == "x":
            return None, float(self.second.wait(8.0)), True
        if self.steps == 1:
            return "go on", 0.0, False
        self.second.set()
        return None, 1.0, True


# Agents for agent.function (async def agent(row, client)), as a user's module would hold them.


async def chat_once(row, client):
    """One chat call; the reward is the number of characters of the reply (extras: calls)."""
    answer = await client.chat.completions.create(model="policy", messages=row["prompt"])
    return {"reward": float(len(answer.choices[0].message.content or "")), "calls": 1}


async def raises(row, client):
    await client.chat.completions.create(model="policy", messages=row["prompt"])
    raise RuntimeError("the agent's own bug")


async def no_reward(row, client):
    await client.chat.completions.create(model="policy", messages=row["prompt"])
    return {"answer": "no reward key"}


async def no_call(row, client):
    return 1.0


async def sleeps_past_timeout(row, client):
    await client.chat.completions.create(model="policy", messages=row["prompt"])
    time.sleep(30)  # blocks its own event loop: only the agent's thread
    return 1.0


LATE = {}
"""What :func:`calls_after_its_end`'s late call got (``status``), for the test to read."""


async def calls_after_its_end(row, client):
    """Returns at once, leaving a thread that calls the model once the session has ended."""
    import openai

    base, key = str(client.base_url), client.api_key

    def late():
        time.sleep(1.0)
        late_client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            late_client.chat.completions.create(model="policy", messages=row["prompt"])
            LATE["status"] = 200
        except openai.APIStatusError as err:
            LATE["status"] = err.status_code

    threading.Thread(target=late, daemon=True).start()
    await client.chat.completions.create(model="policy", messages=row["prompt"])
    return 0.5


def not_async(row, client):
    return 1.0
