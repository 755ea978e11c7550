"""The engine's own rendezvous store, and mapping transport errors to engine errors."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import queue
import socket
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch.distributed as dist

from ._errors import CheckpointEngineError, CheckpointEngineTimeout

__all__ = ["blocking", "connect_store", "master_store", "peer_errors"]

T = TypeVar("T")


def _listening_socket(host: str) -> socket.socket:
    """A socket listening on a free port of ``host``'s address only (torch's own TCPStore
    server listens on every interface whatever host it is given)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise CheckpointEngineError(f"host {host!r}: cannot be resolved ({err})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise CheckpointEngineError(
            f"host {host!r}: cannot listen there ({err}); give an address of this machine "
            "that the receivers can reach"
        ) from None
    return sock


def master_store(host: str, timeout: float) -> dist.TCPStore:
    """A TCPStore served by this process on a free port (``store.port``) of ``host``'s
    address only: loopback when ``host`` is (every member on this machine), the interface
    named otherwise; ``0.0.0.0`` asks for every interface."""
    sock = _listening_socket(host)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),  # the store owns the descriptor from here
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
