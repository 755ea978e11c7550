"""Fully-async mode: the sample queue between rollout workers and the trainer, with verl's
staleness control.

Units are prompt *groups* (one prompt with its ``rollout.n`` samples), because GRPO
needs whole groups. With ``R`` groups per update (``data.train_batch_size``),
``T = trigger_parameter_sync_step`` and ``S = staleness_threshold``:

- a rollout worker asks :meth:`SampleQueue.next_task` what to do: generate a chunk of
  groups, receive a weight update, run its part of a validation, wait (paused), or stop;
- every group it starts counts toward ``stale``; workers pause while
  ``stale >= R x T x (1 + S)`` (verl's ``max_required_samples``). When a weight sync is
  requested ``stale`` restarts from the groups not yet trained, all generated with older
  weights: those queued, those being generated, and those already taken for an update that
  has not run yet (the trainer takes the next update's groups while the current one runs);
  groups the trainer took and dropped (dynamic sampling, :meth:`SampleQueue.release`) are
  not among them;
- the trainer takes the ``R`` oldest groups per update (by weight version, then data
  position) with :meth:`SampleQueue.get`;
  a group whose version lags the trainer's by more than ``max_version_lag`` is dropped
  (and frees its place under the bound) and its prompt generated again with newer weights
  (``async.max_off_policy_strategy=drop``), or kept and trained with the off-policy
  correction (``keep``); with ``drop`` a worker whose weights already lag the trainer's by
  more than that is not handed a group (it could only be dropped);
- :meth:`SampleQueue.request_sync` makes every worker take the new weights at the end of
  its chunk (with partial rollouts: of its current token chunk,
  :meth:`SampleQueue.sync_pending`) before it generates more; each worker goes on as soon
  as it holds them (:meth:`SampleQueue.worker_synced`), without waiting for the others.
  (The rollout workers receive the weights while they generate and only write them in at
  that boundary: :mod:`rlwire.trainer.runtime.rollout_worker`.)

Every wait is bounded: ``next_task`` answers ``wait`` after ``poll`` seconds so a worker
never blocks on the queue indefinitely, and ``get`` gives up after its timeout.
:class:`SampleQueue` is plain asyncio; the driver runs it as an async Ray actor.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from .queue_relays import FleetRelay, ValidationRelay, _wait

__all__ = ["SampleQueue", "max_stale_groups"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Queued:
    """A group in the queue: the weight version and worker that generated it, and its data
    position (the index of its prompt in the stream of groups)."""

    version: int
    worker: int
    index: int
    group: Any


def max_stale_groups(groups_per_step: int, trigger_sync: int, staleness_threshold: float) -> int:
    """verl's ``max_required_samples``: ``int(R x T x (1 + S))`` groups."""
    return int(groups_per_step * trigger_sync * (1 + staleness_threshold))


class SampleQueue(ValidationRelay, FleetRelay):
    """The bounded, versioned queue of prompt groups (see the module docstring)."""

    def __init__(
        self,
        *,
        batches: Callable[[int], list[Any]],
        groups_per_step: int,
        trigger_sync: int,
        staleness_threshold: float,
        max_version_lag: int,
        strategy: str = "drop",
        num_workers: int,
        start_version: int,
        chunk_groups: int | None = None,
        seed: int,
        resume: dict[str, Any] | None = None,
        poll: float = 1.0,
    ) -> None:
        """``resume``: a checkpoint's :meth:`position` (the data position to go on from and the
        groups to generate again first); without it, the stream starts at the start
        version's first group."""
        self.batches = batches
        self.required = groups_per_step
        self.bound = max_stale_groups(groups_per_step, trigger_sync, staleness_threshold)
        self.max_lag = max_version_lag
        self.strategy = strategy  # async.max_off_policy_strategy: drop (and redo) or keep
        self.trainer_version = start_version  # the newest update get() was asked for
        # the prompt groups of one generation task (``async.chunk_groups``)
        self.chunk = chunk_groups or max(1, math.ceil(groups_per_step / num_workers))
        self.seed = seed
        self.poll = poll
        self.queue: collections.deque[_Queued] = collections.deque()
        self.cond = asyncio.Condition()
        self.version = start_version  # of the weights the workers were last synced to
        self.stale = 0
        self.in_flight = 0
        self.next_group = start_version * groups_per_step  # the data position follows the step
        self.redo: collections.deque[int] = collections.deque()
        if resume is not None:  # groups started but not trained when the checkpoint was saved
            self.next_group = resume["next_group"]
            self.redo.extend(resume["pending"])
        self.open: set[int] = set()  # handed out, neither taken for an update nor dropped
        self.assigned: dict[int, set[int]] = {}  # worker -> handed to it, not yet put
        self.absent: set[int] = set()  # dead, or replaced and not yet in the weight group
        self.retake: set[int] = set()  # hold sync_to, and take its re-send again (resync)
        self.taken_groups: dict[int, list[int]] = {}  # trainer version -> the groups taken
        self.sync_to: int | None = start_version  # workers start by receiving the weights
        self.worker_versions = [-1] * num_workers
        self.sync_info: list[dict] = [{} for _ in range(num_workers)]
        self.stopping = False
        self.dropped = 0
        self.dropped_reported = 0  # of self.dropped, how many get() has reported
        self.generated = 0
        self.taken: dict[int, int] = {}  # trainer version -> groups taken for that update
        self.paused_s = [0.0] * num_workers
        self.sync_wait_s = [0.0] * num_workers  # at a boundary, until the weights were in
        self.commit_s = [0.0] * num_workers  # generation stopped to write the weights in
        ValidationRelay.__init__(self)

    # --- the rollout workers' side -------------------------------------------------------
    def _may_generate(self, worker: int) -> bool:
        """Under the bound, holding the newest weights requested (each worker on its own:
        one that took them goes on while the others finish their chunks)."""
        current = self.sync_to is None or self.worker_versions[worker] == self.sync_to
        return current and self.stale < self.bound and self._admits(self.worker_versions[worker])

    def _admits(self, version: int) -> bool:
        """Whether a group started with weights ``version`` can still be trained: under
        ``drop``, not if it already lags the trainer by more than ``max_version_lag``."""
        return self.strategy == "keep" or self.trainer_version - version <= self.max_lag

    async def next_task(
        self,
        worker: int,
        *,
        put: tuple | None = None,
        synced: dict | None = None,
        may_generate: bool = True,
        poll: float | None = None,
    ) -> dict[str, Any]:
        """What ``worker`` does next: ``generate``, ``sync``, ``wait`` or ``stop``.

        ``put`` (the arguments of :meth:`put` after ``worker``) and ``synced`` (those of
        :meth:`worker_synced`) report the previous task first, in the same call (one round
        trip per chunk instead of two). A ``sync`` carries, under ``then``, the generation
        that follows it when the bound allows one (the worker reports the sync while it
        generates). ``may_generate=False``: the worker has no room for more (its requests
        in flight fill its engine): anything but ``generate``. Answers within ``poll``
        seconds (the queue's by default); time spent held back by the staleness bound
        counts as this worker's paused time.
        """
        if put is not None:
            await self.put(worker, *put)
        if synced is not None:
            await self.worker_synced(worker, synced)
        async with self.cond:
            start = time.perf_counter()
            paused = 0.0
            try:
                while True:
                    if self.stopping:
                        return {"kind": "stop"}
                    absent = worker in self.absent  # a replacement not in the weight group
                    sync_to = self.sync_to
                    if sync_to is not None and self._must_sync(worker) and not absent:
                        sync = {"kind": "sync", "version": sync_to}
                        if not may_generate or worker in self.validating:
                            return sync
                        if self.stale >= self.bound or not self._admits(sync_to):
                            return sync
                        return {**sync, "then": self._generate(worker)}
                    if worker in self.validating and not absent:
                        return {"kind": "validate", **self.validating.pop(worker)}
                    if may_generate and not absent and self._may_generate(worker):
                        break
                    left = (self.poll if poll is None else poll) - (time.perf_counter() - start)
                    waited = time.perf_counter()
                    woke = left > 0 and await _wait(self.cond, None, left)
                    if not absent:
                        paused += time.perf_counter() - waited  # held by the bound
                    if not woke:
                        return {"kind": "wait"}
            finally:
                self.paused_s[worker] += paused
            return self._generate(worker)

    def _generate(self, worker: int) -> dict[str, Any]:
        """A chunk of groups for ``worker`` to generate (lock held; the bound has room),
        counted now."""
        count = min(self.chunk, self.bound - self.stale)
        indices = [self.redo.popleft() for _ in range(min(count, len(self.redo)))]
        fresh = count - len(indices)
        indices += range(self.next_group, self.next_group + fresh)
        self.next_group += fresh
        self.open.update(indices)
        self.assigned.setdefault(worker, set()).update(indices)
        self.stale += count
        self.in_flight += count
        return {
            "kind": "generate",
            "indices": indices,
            "examples": [self._group(i) for i in indices],
            "seed": self.seed * 7919 + indices[0],
        }

    def _group(self, index: int) -> Any:
        step, position = divmod(index, self.required)
        return self.batches(step)[position]

    async def put(self, worker: int, versions: list[int], groups: list, indices: list[int]) -> None:
        """Finished groups of one chunk (opaque to the queue) from ``worker``; ``versions``:
        the weight version of each group (its oldest token's, with partial rollouts);
        ``indices``: the task's."""
        async with self.cond:
            for version, group, index in zip(versions, groups, indices, strict=True):
                self.queue.append(_Queued(version, worker, index, group))
            self.assigned.get(worker, set()).difference_update(indices)
            self.in_flight -= len(groups)
            self.generated += len(groups)
            self.cond.notify_all()

    async def worker_synced(self, worker: int, info: dict) -> None:
        """``worker`` applied an update (``info``: its version and digest, and ``wait_s``,
        its seconds at the boundary until the weights were in); it generates again at once,
        and once every worker holds the requested version the sync is complete."""
        async with self.cond:
            self.worker_versions[worker] = info["version"]
            self.retake.discard(worker)
            self.sync_info[worker] = info
            self.sync_wait_s[worker] += info.get("wait_s", 0.0)
            self.commit_s[worker] += info.get("commit_s", 0.0)
            self._complete_sync()
            self.cond.notify_all()

    async def sync_pending(self, worker: int) -> int | None:
        """Partial rollouts, between two token chunks: the version ``worker`` must receive
        now, or None when no sync waits for it."""
        async with self.cond:
            return self.sync_to if self._must_sync(worker) else None

    # --- the trainer's side ----------------------------------------------------------------
    def _drop_lagging(self, trainer_version: int) -> int:
        """Drop the queued groups too old for the update of ``trainer_version`` (``drop``:
        their prompts go back to be generated again first); how many."""
        if self.strategy == "keep":
            return 0
        lagging = [g.index for g in self.queue if trainer_version - g.version > self.max_lag]
        kept = [g for g in self.queue if trainer_version - g.version <= self.max_lag]
        dropped = len(lagging)
        self.open.difference_update(lagging)
        self.redo.extend(lagging)
        self.queue = collections.deque(kept)
        self.dropped += dropped
        self.stale -= dropped  # dropped groups free their place under the bound
        if dropped:
            self.cond.notify_all()  # ... which may let a paused worker go on
        return dropped

    async def get(self, count: int, trainer_version: int, timeout: float) -> dict[str, Any]:
        """The ``count`` oldest groups usable by the update of weights ``trainer_version``.

        Returns ``{"groups", "versions", "dropped", "wait_s", "paused_s"}`` (``versions``:
        the weight version each group was generated with; ``dropped``: the groups dropped
        for their lag since the last ``get`` reported drops, here or at a sync request;
        ``paused_s``: the workers' paused seconds so far, summed) or ``{"timeout": True}``
        after ``timeout`` seconds (the caller decides how to fail).
        """
        start = time.perf_counter()
        async with self.cond:
            self.trainer_version = max(self.trainer_version, trainer_version)
            while True:
                self._drop_lagging(trainer_version)
                if len(self.queue) >= count:
                    break
                left = timeout - (time.perf_counter() - start)
                if left <= 0:
                    dropped = self.dropped - self.dropped_reported
                    return {"timeout": True, "queued": len(self.queue), "dropped": dropped}
                await _wait(self.cond, None, min(left, self.poll))
            dropped, self.dropped_reported = self.dropped - self.dropped_reported, self.dropped
            # The oldest weights first (a worker that took new weights goes on while another
            # still finishes its chunk of older ones), then in data order.
            ordered = sorted(self.queue, key=lambda q: (q.version, q.index))
            taken, self.queue = ordered[:count], collections.deque(ordered[count:])
            self.taken[trainer_version] = self.taken.get(trainer_version, 0) + count
            indices = [q.index for q in taken]
            self.open.difference_update(indices)
            self.taken_groups.setdefault(trainer_version, []).extend(indices)
        return {
            "groups": [q.group for q in taken],
            "versions": [q.version for q in taken],
            "indices": indices,
            "dropped": dropped,
            "wait_s": time.perf_counter() - start,
            **self.worker_seconds(),
        }

    def worker_seconds(self) -> dict[str, float]:
        """The workers' seconds so far, summed over them: ``paused_s`` (held by the bound)
        ``sync_wait_s`` (at a boundary until new weights were in) and ``commit_s`` (generation
        stopped while they were written in)."""
        return {
            "paused_s": sum(self.paused_s),
            "sync_wait_s": sum(self.sync_wait_s),
            "commit_s": sum(self.commit_s),
        }

    async def release(self, count: int, trainer_version: int) -> None:
        """``count`` groups taken for the update of ``trainer_version`` were dropped by the
        trainer (dynamic sampling: their rewards were all equal): they free their places
        under the bound, as groups dropped for their lag do, so that the workers can
        generate the groups that replace them; the next sync's recount no longer counts
        them as taken."""
        async with self.cond:
            self.stale -= count
            left = self.taken.get(trainer_version, 0) - count
            if left < 0:
                raise ValueError(
                    f"release: {count} groups of update {trainer_version}, "
                    f"{self.taken.get(trainer_version, 0)} were taken"
                )
            self.taken[trainer_version] = left
            self.cond.notify_all()

    async def request_sync(self, version: int) -> None:
        """Workers take weights ``version`` at the end of their chunk. The staleness count
        restarts here: everything not yet trained was generated with older weights, and
        every group a worker starts from now on is generated with these."""
        async with self.cond:
            self.sync_to, self.retake = version, set()
            self._drop_lagging(version)
            self.taken = {v: c for v, c in self.taken.items() if v >= version}
            self.stale = len(self.queue) + self.in_flight + sum(self.taken.values())
            self.cond.notify_all()

    async def wait_synced(self, version: int, timeout: float) -> list[dict] | None:
        """Each worker's sync info once all hold weights ``version``; None on timeout."""
        async with self.cond:
            done = await _wait(
                self.cond, lambda: self.sync_to is None and self.version == version, timeout
            )
            return list(self.sync_info) if done else None

    async def position(self, trained: int) -> dict[str, Any]:
        """What a checkpoint after ``trained`` updates keeps of the stream: the next data
        position and every group started but not trained by then (queued, being generated,
        taken for a later update, or still to be generated again: those dropped for their
        lag too), to generate again first on resume: none is lost, none trained twice."""
        async with self.cond:
            self.taken_groups = {v: g for v, g in self.taken_groups.items() if v >= trained}
            later = [i for groups in self.taken_groups.values() for i in groups]
            pending = sorted({*self.open, *later, *self.redo})
            return {"next_group": self.next_group, "pending": pending}

    async def stop(self) -> None:
        async with self.cond:
            self.stopping = True
            self.cond.notify_all()
