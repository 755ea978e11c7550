"""``naive``: in-process hand-over, for trainer and rollout sharing one process."""

from __future__ import annotations

import asyncio
import functools
import queue
import secrets
import threading
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import torch

from .._base import CheckpointEngine, TransferStats, Weights
from .._errors import CheckpointEngineError
from .._store import blocking
from .._wire import aiter_weights

__all__ = ["NaiveEngine"]

_END = object()
_TURNS = 4  # yields to this event loop's other tasks before waiting in a thread

_Item = tuple[Any, Any]  # (name, tensor), or (_END, version) closing an update
_T = TypeVar("_T")


class _Channel:
    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.lock = threading.Lock()
        self.queues: dict[int, queue.Queue[_Item]] = {}
        self.done: dict[int, queue.Queue[bool]] = {}

    def join(self, rank: int) -> None:
        with self.lock:
            self.queues[rank] = queue.Queue(self.maxsize)
            self.done[rank] = queue.Queue()


_channels: dict[str, _Channel] = {}
_channels_lock = threading.Lock()


class NaiveEngine(CheckpointEngine):
    """Hands ``(name, tensor)`` pairs to receivers in the same process through bounded queues.

    ``copy=False`` receivers get the sender's own tensors (zero copy: valid as
    long as the trainer does not modify them); ``copy=True`` receivers get
    clones. A receiver that stops consuming makes the sender time out once its
    queue (``max_pending`` items) is full.
    """

    name = "naive"

    def __init__(self, *, max_pending: int = 1024, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_pending = max_pending
        self._channel: _Channel | None = None
        self._id: str | None = None

    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        self._id = secrets.token_hex(8)
        with _channels_lock:
            _channels[self._id] = _Channel(self.max_pending)
        return {"channel": self._id}

    def _join(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        with _channels_lock:
            channel = _channels.get(master_metadata.get("channel", ""))
        if channel is None:
            raise CheckpointEngineError(
                "naive: no channel named in master_metadata in this process; the naive "
                "backend only works when sender and receivers share a process"
            )
        self._channel = channel
        if rank > 0:
            channel.join(rank)

    @property
    def _joined_channel(self) -> _Channel:
        assert self._channel is not None, "naive: used before init_process_group()"
        return self._channel

    async def _wait_receivers(self) -> dict[int, queue.Queue[_Item]]:
        channel, expected = self._joined_channel, set(range(1, self._joined_world_size))

        def joined_now() -> dict[int, queue.Queue[_Item]] | None:
            with channel.lock:
                if expected <= channel.queues.keys():
                    return {r: channel.queues[r] for r in sorted(expected)}
            return None

        def joined() -> dict[int, queue.Queue[_Item]]:
            import time

            deadline = time.monotonic() + self.timeout
            while (queues := joined_now()) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("receivers did not join")
                time.sleep(0.001)
            return queues

        # Joined already (the usual case): no thread to wait in.
        queues = joined_now()
        if queues is not None:
            return queues
        return await blocking(joined, "naive: waiting for receivers to join", self.timeout)

    async def _send(self, weights: Weights, version: int) -> TransferStats:
        queues = await self._wait_receivers()
        nbytes = tensors = 0

        async def put_all(item: _Item) -> None:
            for rank, q in queues.items():
                try:
                    q.put_nowait(item)
                except queue.Full:
                    await blocking(
                        functools.partial(q.put, item, timeout=self.timeout),
                        f"naive: receiver {rank} is not consuming",
                        self.timeout,
                    )

        async for name, tensor in aiter_weights(weights):
            await put_all((name, tensor))
            nbytes += tensor.numel() * tensor.element_size()
            tensors += 1
        await put_all((_END, version))
        for rank in queues:
            await self._next(
                self._joined_channel.done[rank], f"naive: waiting for receiver {rank} to finish"
            )
        return TransferStats(nbytes, tensors, 1, 0.0)

    async def _receive(
        self, copy: bool, base_version: int | None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        q = self._joined_channel.queues[self._joined_rank]
        while True:
            name, tensor = await self._next(q, "naive: waiting for the sender")
            if name is _END:
                self.last_version = tensor
                self._joined_channel.done[self._joined_rank].put(True)
                return
            yield name, (tensor.detach().clone() if copy else tensor.detach())

    async def _next(self, q: queue.Queue[_T], what: str) -> _T:
        """The next item of ``q``. A peer in this event loop (sender and receiver awaited
        together in one thread) gets a few turns first, so that it needs no thread; a peer
        in another thread is waited for in one, bounded by ``timeout``."""
        for _ in range(_TURNS):
            try:
                return q.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0)
        return await blocking(lambda: q.get(timeout=self.timeout), what, self.timeout)

    def finalize(self) -> None:
        super().finalize()
        if self._id is not None:
            with _channels_lock:
                _channels.pop(self._id, None)
        self._channel = None
