"""The sample queue's relays (mixed into :class:`~.sample_queue.SampleQueue`): validation
between syncs, and the rollout workers that die and are replaced (fully-async healing,
:mod:`rlwire.trainer.runtime.healing`)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

__all__ = ["FleetRelay", "ValidationRelay"]


async def _wait(
    cond: asyncio.Condition, predicate: Callable[[], bool] | None, timeout: float
) -> bool:
    """Wait (``cond`` held) until ``predicate()``, or any notification when it is None;
    False on timeout."""
    waiting = cond.wait() if predicate is None else cond.wait_for(predicate)
    try:
        await asyncio.wait_for(waiting, timeout)
    except TimeoutError:
        return False
    return True


class ValidationRelay:
    """Validation between syncs: each worker runs its share of the held-out prompts at its
    next boundary, before generating more; the driver waits for all of them. Mixed into
    :class:`SampleQueue` (which sets ``cond``)."""

    cond: asyncio.Condition

    def __init__(self) -> None:
        self.validating: dict[int, dict] = {}  # worker -> its validation task, not yet taken
        self.validated: dict[int, Any] = {}
        self.validations = 0  # tasks of the current validation
        self.validation_lost: int | None = None  # a worker that died with a part of it

    async def request_validation(self, tasks: list[dict | None]) -> None:
        """Worker ``i`` runs ``tasks[i]`` (``prompts``, ``seed``, ``sampling``; None: nothing)
        at its next boundary, before generating more."""
        async with self.cond:
            self.validating = {i: t for i, t in enumerate(tasks) if t is not None}
            self.validations, self.validated = len(self.validating), {}
            self.validation_lost = None
            self.cond.notify_all()

    async def put_validation(self, worker: int, rollout: Any) -> None:
        async with self.cond:
            self.validated[worker] = rollout
            self.cond.notify_all()

    async def validation_result(self, timeout: float) -> list | None:
        """The workers' validation rollouts in worker order once all are in; None on
        timeout; a worker that died with a part of it is an error (not healed)."""
        async with self.cond:
            done = await _wait(
                self.cond,
                lambda: len(self.validated) == self.validations or self.validation_lost is not None,
                timeout,
            )
            if self.validation_lost is not None:
                raise RuntimeError(f"rollout worker {self.validation_lost} died during it")
            return [self.validated[w] for w in sorted(self.validated)] if done else None


class FleetRelay:
    """Rollout workers that die and are replaced (fully async). Mixed into
    :class:`SampleQueue`, whose state it keeps right: the groups handed to a worker and not
    yet put (``assigned``) go back to be generated first when it dies, freeing their places
    under the bound; a dead worker, and its replacement until it joined the weight group,
    is ``absent``: handed nothing, and a sync completes without it."""

    cond: asyncio.Condition
    assigned: dict[int, set[int]]
    absent: set[int]
    open: set[int]
    redo: collections.deque[int]
    in_flight: int
    stale: int
    worker_versions: list[int]
    sync_info: list[dict]
    validating: dict[int, dict]
    validated: dict[int, Any]
    validations: int
    validation_lost: int | None
    sync_to: int | None
    version: int
    retake: set[int]

    def _must_sync(self, worker: int) -> bool:
        """(lock held) Whether ``worker`` is to take the version a sync asks for at its next
        boundary: it holds another, or it holds that one and must take it again
        (:meth:`resync`)."""
        return self.sync_to is not None and (
            self.worker_versions[worker] != self.sync_to or worker in self.retake
        )

    def _synced_all(self) -> bool:
        """Every worker present holds the version a sync asked for, none still to take it
        again (and one is present: with every worker gone, the replacements that join take
        it first)."""
        present = [v for w, v in enumerate(self.worker_versions) if w not in self.absent]
        again = self.retake - self.absent
        return bool(present) and all(v == self.sync_to for v in present) and not again

    async def resync(self, version: int) -> None:
        """The push of ``version`` is sent again, whole, to the re-formed group (a member
        died during it, or every member did): every present worker takes it at its next
        boundary, those that hold it already too (they receive it again, and an update
        received must be written in before the next: they write the same weights in), and
        the sync completes once they all did."""
        async with self.cond:
            self.sync_to = version
            self.retake = {
                w
                for w, v in enumerate(self.worker_versions)
                if w not in self.absent and v == version
            }
            self.cond.notify_all()

    def _complete_sync(self) -> None:
        """(lock held) The sync asked for is complete once every present worker holds it."""
        if self.sync_to is not None and self._synced_all():
            self.version, self.sync_to = self.sync_to, None

    async def worker_lost(self, worker: int) -> list[int]:
        """``worker`` died: the groups it was generating go back to be generated first (the
        data positions, returned), it is absent until its replacement joins, and a sync in
        progress completes without it. A validation it had a part of cannot complete."""
        async with self.cond:
            lost = sorted(self.assigned.pop(worker, set()))
            self.open.difference_update(lost)
            self.redo.extendleft(reversed(lost))
            self.in_flight -= len(lost)
            self.stale -= len(lost)  # counted again when they are handed out again
            self.absent.add(worker)
            self.retake.discard(worker)
            self.worker_versions[worker] = -1
            self.sync_info[worker] = {}
            if worker in self.validating or (self.validations and worker not in self.validated):
                self.validation_lost = worker  # validation_result says so at once
            self._complete_sync()
            self.cond.notify_all()
            return lost

    async def worker_joined(self, worker: int) -> None:
        """``worker``'s replacement is in the weight group: it takes the next sync, then
        generates."""
        async with self.cond:
            self.absent.discard(worker)
            self.cond.notify_all()
