"""Rollout workers that heal: a rollout worker that dies, or whose engine is lost (its
server stopped answering: :class:`~rlwire.trainer.rollout.EngineLost`), is replaced while
training goes on.

Colocated and one-step off modes (every rollout worker holds the same weights while it
generates; the driver makes every call; :class:`~.job.Job`), where a worker's death is seen:

- **generation**: the other workers' shares are kept; the dead worker's share (its prompt
  groups) is generated again by a worker that lived through the call, with the dead one's
  seed and the same weights, so the batch is the one the run would have had (on an engine
  whose generation is deterministic, bit for bit). With no such worker left, the
  replacement joins at once, receives the actor's current weights and generates it (its
  samples are stamped with that version). The groups are counted (``regenerated_groups``)
  and named in the log.
- **weight sync**: the send is aborted at once on every member (the checkpoint engine's
  ``abort``: the sender does not wait ``ckpt_engine.timeout`` for the dead receiver), the
  worker is replaced, the group re-formed, and the same version sent again, whole. A
  receiver writes an update in only once it arrived whole, so the survivors hold the old
  weights or the new ones, never a mix.

Fully-async mode (:mod:`rlwire.trainer.modes.fully_async`): a worker's loop that ends in its
death is replaced (:attr:`~.waits.Watch.heal`); the groups it held go back to be generated
first and it is absent from the sample queue (handed nothing; a sync completes without it)
until its replacement joined the weight group (the queue's ``worker_lost`` and
``worker_joined``), at the first push after its engine loaded (the pushes go on without it
meanwhile). A death during a push aborts it on every member at once and sends the same
version again to the survivors (:mod:`rlwire.trainer.modes.async_push`).

A replacement is a new Ray actor of the same index with its own engine (``vllm_server``:
a new server: the dead worker's watchdog stopped the old one; with ``rollout.server_urls``,
the same server, waited for with backoff and taken back holding this run's weights); it
joins the checkpoint engine's group when the group is re-formed, before the next sync, and
the sync that follows gives it the current weights before it generates. The group is re-formed on
every backend the same way: a new master (a new store, new shared memory) and every member
joined anew, so the first update after it is whole (deltas need a base every member holds).

Lock-step syncs wait for a replacement still loading, unless its engine
:attr:`~rlwire.trainer.rollout.RolloutEngine.rejoins` (``vllm_server``: a server to start,
or one to wait for): then the group is re-formed without it and another worker generates its
share, with its seed, until it loaded (:meth:`Fleet.rejoin`, :meth:`Fleet.assign`).

A death during a lock-step validation is healed as one during generation: the dead
worker's held-out share is validated again by another, with its seed.

``rollout.max_restarts`` replacements per worker within ``rollout.restart_window_s``; the
next death stops the run with the line a death always gave. The hybrid engine (no rollout
process of its own) and a death during a fully-async validation are not healed: the death
stops the run.
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config.root import TrainerConfig
from ..errors import RunError
from ..rollout import rollout_engine_class
from .cluster import Handle
from .waits import RolloutLost, Watch

__all__ = ["Fleet", "FleetJob", "RolloutLost"]

log = logging.getLogger("rlwire.trainer")


class FleetJob(Protocol):
    """What a :class:`Fleet` uses of its job (:class:`~.job.Job` has it all): the job's
    rollout workers, their processes and waits, and the weight group it re-forms."""

    config: TrainerConfig
    hybrid: bool
    rollouts: list[Handle]
    """The rollout workers by index (the fleet puts a replacement in its place)."""
    processes: list[Handle]
    members: list[int]
    """The rollout workers in the weight group, by rank."""
    engine_backend: str
    watch: Watch
    local_pids: list[int]

    def reform_weight_group(self, members: list[int] | None = None) -> None: ...


class Fleet:
    """A job's rollout workers as a fleet that heals: who died, who replaces them, what
    the replacements still need (the weight group), and the counts the metrics report."""

    def __init__(self, job: FleetJob, make: Callable[[int, int], Handle]) -> None:
        """``make(index, restart)``: a new rollout worker actor of that index (not loaded)."""
        self.job, self.make = job, make
        cfg = job.config.rollout
        self.max_restarts, self.window = cfg.max_restarts, cfg.restart_window_s
        self.heals = (
            cfg.max_restarts > 0
            and job.config.trainer.mode in ("colocated", "one_step_off", "fully_async")
            and not job.hybrid
        )
        """Whether a dead rollout worker is replaced (else its death stops the run)."""
        self.waits_out = rollout_engine_class(cfg.backend).rejoins
        """Whether lock-step syncs go on without a replacement still loading (an engine that
        :attr:`~rlwire.trainer.rollout.RolloutEngine.rejoins`: ``vllm_server``, whose
        replacement starts a server, minutes, or waits for one that stopped answering)."""
        self.restarts: dict[int, collections.deque[float]] = collections.defaultdict(
            collections.deque
        )
        self.total = 0
        """Replacements so far (``rollout_restarts``)."""
        self.regenerated = 0
        """Prompt groups generated again since the last step's record."""
        self.joining: set[int] = set()
        """Replacements not yet in the checkpoint engine's group."""
        self.loading: dict[int, tuple[Any, float]] = {}
        """Replacement index -> (its ``load_engine`` call, when it was started)."""

    @property
    def live(self) -> int:
        """Rollout engines in the weight group (``rollout_engines_live``)."""
        return len(self.job.rollouts) - len(self.joining)

    def record(self) -> dict[str, Any]:
        """The fleet's fields of a step's metrics line (the regenerated count restarts)."""
        fields: dict[str, Any] = {
            "rollout_restarts": self.total,
            "rollout_engines_live": self.live,
        }
        if self.regenerated:
            fields["regenerated_groups"] = self.regenerated
        self.regenerated = 0
        return fields

    def replace(self, lost: RolloutLost) -> None:
        """Start a replacement for worker ``lost.index`` and load its engine; ``lost`` is
        raised instead when the run does not heal or the worker used up its restarts."""
        if not self.heals:
            raise lost
        index, now = lost.index, time.monotonic()
        recent = self.restarts[index]
        while recent and now - recent[0] > self.window:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            raise RunError(
                f"{lost} (rollout worker {index} was replaced {len(recent)} times within "
                f"{self.window:g} s: rollout.max_restarts, rollout.restart_window_s)"
            ) from None
        recent.append(now)
        self.total += 1
        what = "lost its engine" if lost.engine_lost else "died"
        _say(
            f"rollout worker {index} {what}; starting its replacement (restart {len(recent)} of "
            f"{self.max_restarts} within {self.window:g} s): {_first_clause(str(lost))}"
        )
        self._start(index)

    def _start(self, index: int) -> None:
        """Start worker ``index``'s replacement; its engine loads while the run goes on
        (:meth:`rejoin` waits for it)."""
        import ray

        job = self.job
        old = job.rollouts[index]
        ray.kill(old, no_restart=True)
        new = self.make(index, self.total)
        loading = new.load_engine.remote(job.engine_backend, rejoin=True)
        self.loading[index] = (loading, time.perf_counter())
        job.rollouts[index] = new
        job.processes[job.processes.index(old)] = new
        actor = new._actor_id.hex()
        job.watch.names[actor] = f"rollout worker {index}"
        job.watch.rollouts[actor] = index
        self.joining.add(index)

    @property
    def present(self) -> list[int]:
        """The rollout workers in service: all but the replacements still joining."""
        return [i for i in range(len(self.job.rollouts)) if i not in self.joining]

    def assign(self, shares: int) -> list[int]:
        """The worker that generates each of ``shares`` (one per rollout worker, by index):
        its own, or, for a worker still joining, the workers in service in turn."""
        present = self.present
        if not present:  # (a sync waits for the replacements first: not reached)
            return list(range(shares))
        absent = [i for i in range(shares) if i not in present]
        return [
            i if i in present else present[absent.index(i) % len(present)] for i in range(shares)
        ]

    def rejoin(self) -> None:
        """Before a lock-step sync, re-form the checkpoint engine's group with the
        replacements whose engines loaded (the sync gives them the current weights).
        Replacements of an engine that loads in seconds are waited for (each bounded by
        ``ray.startup_timeout``); those of an engine that :attr:`waits_out` (a server to
        start, or one given by URL that stopped answering) join at the first sync after
        they loaded, and the run goes on without them meanwhile, unless no worker would be
        left."""
        if not self.joining:
            return
        joined = self.ready() if self.waits_out else self.wait_loaded()
        if not self.present:
            joined += self.wait_loaded()
        if joined or self.present != self.job.members:
            self.job.reform_weight_group(self.present)

    def wait_loaded(self) -> list[int]:
        """Wait for every replacement's engine to load (each bounded by
        ``ray.startup_timeout``): no longer joining, to be in the group re-formed next."""
        return self._joined(sorted(self.loading))

    def ready(self) -> list[int]:
        """Fully async: the replacements whose engines have loaded, without waiting for the
        others (a ``vllm serve`` server takes minutes): no longer joining, to be in the
        group re-formed next."""
        import ray

        loaded = [i for i, (ref, _) in self.loading.items() if ray.wait([ref], timeout=0)[0]]
        return self._joined(sorted(loaded))

    def _joined(self, indices: list[int]) -> list[int]:
        """Replacements ``indices``, loaded (:meth:`_loaded`), no longer joining."""
        for index in indices:
            self._loaded(index)
            self.joining.discard(index)
        return indices

    def _loaded(self, index: int) -> None:
        """Wait for replacement ``index``'s engine (bounded by ``ray.startup_timeout``) and
        note where it runs."""
        import ray

        job, here = self.job, ray.get_runtime_context().get_node_id()
        timeout = job.config.ray.startup_timeout
        loaded, start = self.loading.pop(index)
        what = f"starting the replacement of rollout worker {index}"
        job.watch.get(loaded, timeout=timeout, what=what)
        worker = job.rollouts[index]
        where = worker.node.options(concurrency_group="receive").remote()  # beside run()
        node, pid = job.watch.get(where, timeout=timeout, what=what)
        if node == here:  # close() sweeps the shared memory its workers leave here
            job.local_pids.append(pid)
        log.info("rollout worker %d replaced in %.1f s", index, time.perf_counter() - start)

    def regenerating(self, index: int, indices: range, by: int | None, position: int) -> None:
        """Count and name the prompt groups of worker ``index``'s lost share (``by``: the
        worker that generates them again; None: the replacement)."""
        self.regenerated += len(indices)
        if by is None:
            who = "the replacement (no worker held the batch's weights: it took the actor's)"
        else:
            who = f"rollout worker {by}"
        _say(
            f"the {len(indices)} prompt groups rollout worker {index} was generating (batch "
            f"{position}, prompts {indices.start}-{indices.stop - 1}) are generated again by "
            f"{who}"
        )

    def revalidating(self, index: int, prompts: int, by: int | None) -> None:
        """Name the held-out prompts of worker ``index``'s lost validation share that
        ``by`` (None: the replacement) validates again (not counted: they train nothing)."""
        who = "the replacement" if by is None else f"rollout worker {by}"
        _say(
            f"the {prompts} held-out prompts rollout worker {index} was validating are "
            f"validated again by {who}"
        )

    def requeued(self, index: int, positions: list[int]) -> None:
        """Count and name the prompt groups fully async hands out again (data positions)."""
        self.regenerated += len(positions)
        named = ", ".join(map(str, positions)) or "none"
        _say(
            f"the {len(positions)} prompt groups rollout worker {index} was generating (data "
            f"positions {named}) go back to be generated first"
        )


def _first_clause(line: str) -> str:
    return line.split("; the last checkpoint")[0]


def _say(line: str) -> None:
    log.warning("%s", line)
    print(f"rlwire-train: {line}", file=sys.stderr)


def survivors(results: dict[int, Any], lost: set[int]) -> list[int]:
    """The workers whose call succeeded, in index order."""
    return sorted(i for i in results if i not in lost)
