"""Test helper (not a test module): tools and environments named by dotted path in the agent
tests, as a user's module would hold them."""

from __future__ import annotations

import asyncio
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
