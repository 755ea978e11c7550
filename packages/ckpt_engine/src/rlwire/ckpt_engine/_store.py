"""The engine's own rendezvous store, and mapping transport errors to engine errors."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import queue
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch.distributed as dist

from ._errors import CheckpointEngineError, CheckpointEngineTimeout

__all__ = ["blocking", "connect_store", "master_store", "peer_errors"]

T = TypeVar("T")


def master_store(host: str, timeout: float) -> dist.TCPStore:
    """A TCPStore served by this process on a free port (``store.port``)."""
    return dist.TCPStore(
        host,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        use_libuv=True,
    )


def connect_store(meta: dict, timeout: float) -> dist.TCPStore:
    try:
        host, port = meta["host"], int(meta["port"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointEngineError(
            f"master_metadata must hold 'host' and 'port' (from the master's prepare()); "
            f"got {meta!r}"
        ) from None
    with peer_errors(f"connecting to the master's store at {host}:{port}", timeout):
        return dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )


@contextlib.contextmanager
def peer_errors(what: str, timeout: float) -> Iterator[None]:
    """Turn a transport failure (a stalled or dead peer) into ``CheckpointEngineTimeout``."""
    try:
        yield
    except CheckpointEngineError:
        raise
    # DistError subclasses RuntimeError; TimeoutError is an OSError.
    except (RuntimeError, OSError, queue.Empty, queue.Full) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointEngineTimeout(
            f"{what}: no answer within {timeout:g} s or the peer failed ({first})"
        ) from err


async def blocking(fn: Callable[[], T], what: str, timeout: float) -> T:
    """Run a blocking transport call off the event loop, translating peer failures."""
    with peer_errors(what, timeout):
        return await asyncio.to_thread(fn)
