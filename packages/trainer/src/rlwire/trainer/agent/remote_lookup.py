"""The ``lookup`` tool as a remote service looks to the trainer: the same answers, each after
:data:`LATENCY_S` seconds of waiting that use no CPU (a search API).
``agent.tools=[rlwire.trainer.agent.remote_lookup:lookup]``; the benchmarks use it to show
whether the modes hide tool time."""

from __future__ import annotations

import asyncio

from . import lookup as _local

__all__ = ["LATENCY_S", "lookup"]

LATENCY_S = 0.05


async def lookup(key: str, *, table: dict[str, str]) -> str:
    """Look up the code stored under a key.

    Args:
        key: three letters from a to j, as given in the prompt.
        table: the codes by key (the data row's: not the model's to give).
    """
    await asyncio.sleep(LATENCY_S)
    return _local.lookup(key, table=table)
