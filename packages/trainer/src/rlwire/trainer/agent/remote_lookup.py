"""The ``lookup`` tool as a remote service looks to the trainer: the same answers, each after
:data:`LATENCY_S` seconds of waiting that use no CPU (a search API), or
:data:`SANDBOX_LATENCY_S` (a code sandbox).
``agent.tools=[rlwire.trainer.agent.remote_lookup:lookup]`` (or ``:sandbox_lookup``); the
benchmarks use them to show whether the modes hide tool time."""

from __future__ import annotations

import asyncio

from . import lookup as _local

__all__ = ["LATENCY_S", "SANDBOX_LATENCY_S", "lookup", "sandbox_lookup"]

LATENCY_S = 0.05
SANDBOX_LATENCY_S = 0.5


async def lookup(key: str) -> str:
    """Look up the code stored under a key.

    Args:
        key: three letters from a to j, as given in the prompt.
    """
    await asyncio.sleep(LATENCY_S)
    return _local.lookup(key)


async def sandbox_lookup(key: str) -> str:
    """Look up the code stored under a key.

    Args:
        key: three letters from a to j, as given in the prompt.
    """
    await asyncio.sleep(SANDBOX_LATENCY_S)
    return _local.lookup(key)
