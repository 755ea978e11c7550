"""Fully async's weight pushes (:mod:`.fully_async`): one in flight at a time, started
without waiting and finished after the next update; a rollout worker that dies during one
does not end it with the run.

The states of a push: **started** (:meth:`Pushes.start`: the group re-formed where its
members changed, the queue told to expect the version, each sending actor rank sending from
a thread of its own, each member receiving beside its generation), then **finished**
(:meth:`Pushes.finish`: rank 0's send ended and every member wrote the version in). A
member's death while a push is in flight (seen wherever the driver waits:
:meth:`Pushes.member_died`, from the fleet's heal) makes it **re-sent**: the send is aborted
at once on every member (the checkpoint engine's ``abort``, instead of the sender waiting
``ckpt_engine.timeout`` for the dead one while the survivors wait at their boundary for the
version and the trainer for their samples), every call of the transfer ends, the group is
re-formed without the dead worker (its replacement joins at a later push, as after any
death), and the same version is sent again, whole. The survivors keep the weights they hold
and wait at their boundary for it (``WeightStage._take_staged``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import RunError
from ..runtime.cluster import Handle
from ..runtime.job import Job
from ..runtime.waits import RolloutLost, Watch

__all__ = ["Pushes"]


class Pushes:
    """The pushes of one fully-async run (``watch``: its waits, with the rollout loops;
    ``heal``: replaces a dead worker and returns its new loop)."""

    def __init__(
        self, job: Job, queue: Handle, watch: Watch, wait_s: float, heal: Callable[..., Any]
    ) -> None:
        self.job, self.queue, self.watch, self.wait_s, self.heal = job, queue, watch, wait_s, heal
        self.version: int | None = None
        """The version in flight (None: no push is)."""
        self.last: int | None = None
        """The last version started (actor rank 0 keeps its snapshot: ``resend_push``)."""
        self.calls: list = []
        """Its calls: the queue's request, each actor rank's ``start_push`` (or
        ``resend_push``), each member's ``stage_weights``."""
        self.finished: list | None = None
        """Each actor rank's ``finish_push`` (None: not asked yet)."""
        self.aborted = False
        """Whether the group's engines were aborted (re-formed before the next send)."""

    def start(self, version: int, *, request: bool = True) -> None:
        """Ask the workers to take ``version`` at their next boundary and hand it over:
        each actor rank gathers the weights, rank 0 sends them from a thread of its own and
        goes on with its next calls; each member receives them beside its generation.
        Nothing here waits for the transfer (:meth:`finish`). ``request``: tell the queue
        (not for the first push, which every worker takes before it generates)."""
        self._join()
        self.version = self.last = version
        self.calls = [self.queue.request_sync.remote(version)] if request else []
        self.calls += [actor.start_push.remote(version) for actor in self.job.actors]
        self.calls += self._receives(version)  # (after start_push: before the next update)
        self.finished = None

    def finish(self) -> dict[str, Any]:
        """Wait until every sending rank's send ended and every member wrote the version in:
        the sends' report, with each member's (``pulls``); re-sent first if a member dies
        meanwhile."""
        version = self.version
        assert version is not None, "finish() with no push in flight"
        # The workers write it in at their next boundary, after the generation they are in:
        # bounded by async.sample_timeout; the transfer by the engine (ckpt_engine.timeout
        # per wait: a large model may outlast any fixed budget for the whole).
        synced = self.queue.wait_synced.remote(version, self.wait_s)
        while True:
            if self.finished is None:  # (asked for anew after a re-send)
                self.finished = [a.finish_push.remote() for a in self.job.actors]
            calls, finished = self.calls, self.finished
            try:
                done = self.watch.get([*calls, *finished, synced], timeout=None, what="weight sync")
                pushes, pulls = done[len(calls) : -1], done[-1]
                break
            except RunError as err:
                if self.calls is not calls:  # a death re-sent it meanwhile (its abort failed
                    continue  # these calls)
                if isinstance(err, RolloutLost) and self._unhealed(err):
                    index = err.index  # its loop's end not seen yet: replaced now, re-sent
                    self.watch.loops[index] = self.heal(err)
                    continue
                raise
        self.version = None
        if pulls is None:
            raise RunError(
                f"weight sync: the rollout workers did not reach a boundary to take version "
                f"{version} within {self.wait_s:g} s (async.sample_timeout)"
            )
        live = [p for p in pulls if p]  # a dead worker's left out
        return self.job.sync_report(pushes, live, version)

    def drop(self) -> None:
        """Forget every call (the run ends: no reference to a Ray object is kept)."""
        self.calls, self.finished, self.version = [], None, None

    def member_died(self, lost: RolloutLost) -> None:
        """Rollout worker ``lost.index`` died (its replacement is starting). A push in flight
        that it was a member of is aborted and sent again to the others (the module's
        docstring). With no member left, the replacements are waited for (each bounded by
        ``ray.startup_timeout``) and sent the push in flight, or else the last one, which
        every worker held: no samples come until one generates."""
        job = self.job
        if self.version is not None and lost.index in job.members:
            job.abort_push(lost)
            self.aborted = True  # the group takes no further update: re-formed below
            transfer = self.calls + (self.finished or [a.finish_push.remote() for a in job.actors])
            job.settle(transfer, lost)  # (the failed send is collected: the next starts clean)
        elif self._members():
            return  # the others go on; its replacement joins at a later push
        self._join()
        restoring = self.version is None
        if restoring:  # every worker gone between two pushes: the last one again
            self.version = self.last
            self.calls = [self.queue.request_sync.remote(self.last)]
        else:  # each member takes the re-send, those that wrote the version in already too
            self.calls = [self.queue.resync.remote(self.version)]
        assert self.version is not None  # the first push precedes any generation
        self.calls += [actor.resend_push.remote(self.version) for actor in job.actors]
        self.calls += self._receives(self.version)
        self.finished = None
        if restoring:
            self.finish()

    def _join(self) -> None:
        """Re-form the group where its members changed: without a worker that died, with
        the replacements whose engines have loaded (those still loading join a later
        push; until then they are absent from the queue), waiting for them when no member
        would be left."""
        job = self.job
        joined = job.fleet.ready() if job.fleet.joining else []
        if job.fleet.joining and not self._members():
            joined += job.fleet.wait_loaded()
        members = self._members()
        if joined or members != job.members or self.aborted:  # (a replacement may take
            job.reform_weight_group(members)  # a dead member's index)
            self.aborted = False
        if joined:
            self.watch.get(
                [self.queue.worker_joined.remote(i) for i in joined],
                timeout=self.wait_s,
                what="samples",
            )

    def _members(self) -> list[int]:
        """The rollout workers that belong in the group now: all but the replacements
        still joining."""
        return self.job.fleet.present

    def _receives(self, version: int) -> list:
        """Each member's receive of ``version``, on a thread of its own."""
        job = self.job
        return [
            job.rollouts[i].stage_weights.options(concurrency_group="receive").remote(version)
            for i in job.members
        ]

    def _unhealed(self, lost: RolloutLost) -> bool:
        """Whether the worker ``lost`` names is still the dead actor (not replaced yet)."""
        return lost.actor == self.job.rollouts[lost.index]._actor_id.hex()
