"""Fully-async mode: rollout workers keep generating into a :class:`SampleQueue` while the
actor trains; weights go to them every ``async.trigger_parameter_sync_step`` updates.

The trainer's loop overlaps what it can: the groups of the next update are taken from the
queue while the current update runs, and a weight push holds neither the trainer nor the
rollout workers' generation: actor rank 0 gathers the weights into a snapshot and sends it
from a thread of its own while the next update runs; each rollout worker receives it in a
thread of its own while it generates (``RolloutWorker.stage_weights``) and writes it in
between two decoding steps of its engine (with partial rollouts at once, the requests in
flight carrying on; without, once its groups in flight ended:
:mod:`rlwire.trainer.runtime.rollout_serve`), then goes on without waiting for the other
workers. A sync step's metrics line is
written once its sync completed, after the next update.

Deadlines: the transfer is bounded by the checkpoint engine (``ckpt_engine.timeout`` per
wait); the workers' writes, which may come after the generation they are in, by
``async.sample_timeout``, counted from the trainer's wait for the sync (after the next
update), never by the transfer's deadline."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..algorithms.scoring import fill
from ..errors import RunError
from ..outputs.metrics import mean_lag, step_record
from ..rollout import Rollout
from ..runtime.cluster import Handle
from ..runtime.job import Job
from ..runtime.validation import validation_due, validation_metrics, validation_tasks
from ..runtime.waits import RolloutLost, Watch
from .async_push import Pushes
from .sample_queue import SampleQueue

log = logging.getLogger("rlwire.trainer")

__all__ = ["run_fully_async", "sync_due"]


def sync_due(step: int, trigger: int, steps: int) -> bool:
    """Whether the weights go to the rollout workers after update ``step`` (0-based).

    Every ``trigger``-th update of the run counted from its first step, so a resumed
    run syncs at the same steps as one that never stopped; never after the last update.
    """
    return (step + 1) % trigger == 0 and step + 1 < steps


def run_fully_async(job: Job, bar) -> None:
    """Train on groups from the queue while the rollout workers keep generating."""
    import ray

    config = job.config
    cfg = config.async_
    n, required = config.rollout.n, config.data.train_batch_size
    filtering = config.fills_batches()
    trigger = cfg.trigger_parameter_sync_step
    Queue = ray.remote(num_cpus=0)(SampleQueue)
    queue: Handle = Queue.options(name="sample-queue", namespace=job.namespace).remote(
        batches=job.data.batches,
        groups_per_step=required,
        trigger_sync=trigger,
        staleness_threshold=cfg.staleness_threshold,
        max_version_lag=cfg.version_lag_bound(),
        strategy=cfg.max_off_policy_strategy,
        num_workers=len(job.rollouts),
        chunk_groups=cfg.chunk_groups,
        start_version=job.start_step,
        seed=config.trainer.seed,
        resume=job.resumed.get("queue"),  # groups started before the checkpoint, to redo
    )
    wait_s = cfg.sample_timeout
    for index in sorted(job.fleet.joining):  # replaced while the weight group first formed:
        ray.get(queue.worker_lost.remote(index), timeout=wait_s)  # absent until it joins
    loops = [r.run.remote(queue) for r in job.rollouts]
    watch = Watch(loops, job.watch.names, job.watch.rollouts)

    def replace(lost: RolloutLost) -> Any:
        """A rollout worker died: its replacement starts (or ``lost`` is raised: the fleet
        does not heal, or the worker used up its restarts), the groups it was generating go
        back to be generated first, and the replacement's loop waits, handed nothing, until
        it joins the weight group at a later sync (:mod:`rlwire.trainer.runtime.healing`).
        The new loop. (A death while the weight group forms: this alone.)"""
        job.fleet.replace(lost)
        lost_groups = ray.get(queue.worker_lost.remote(lost.index), timeout=wait_s)
        job.fleet.requeued(lost.index, lost_groups)
        new_loop = job.rollouts[lost.index].run.remote(queue)
        watch.loops[lost.index] = new_loop  # before any wait below sees the dead one again
        return new_loop

    def heal(lost: RolloutLost) -> Any:
        """:func:`replace`, and a push it was receiving is sent again to the others."""
        new_loop = replace(lost)
        pushes.member_died(lost)
        return new_loop

    job.setup_lost = replace
    watch.heal = heal
    pushes = Pushes(job, queue, watch, wait_s, heal)

    def take(step: int, count: int = required):
        """Ask for ``count`` groups for update ``step`` (answered once they are there)."""
        return queue.get.remote(count, step, wait_s)

    def taken(ref, count: int = required) -> dict[str, Any]:
        got = watch.get(ref, timeout=wait_s + 30, what="samples")
        if got.get("timeout"):
            raise RunError(
                f"fully_async: fewer than {count} prompt groups arrived within "
                f"{wait_s:g} s (async.sample_timeout; {got['queued']} queued)"
            )
        return got

    def validate(version: int) -> None:
        """The held-out prompts on every worker with the weights they hold (``version``,
        just synced): each takes its share at its next boundary; training waits."""
        tasks = validation_tasks(job, job.data.validation)
        watch.get(queue.request_validation.remote(tasks), timeout=wait_s, what="validation")
        timeout = config.ray.task_timeout
        parts = watch.get(
            queue.validation_result.remote(timeout), timeout=timeout + 30, what="validation"
        )
        if parts is None:
            raise RunError(
                f"validation: the rollout workers did not finish it within {timeout:g} s"
            )
        job.validate(version, lambda: validation_metrics(job, job.data.validation, parts))

    unsynced: dict[str, Any] = {"weight_sync_gbps": 0.0, "pulls": []}
    pending = None  # a step whose record waits for its weight sync to complete

    def write(step: int, synced: dict[str, Any], fields: dict[str, Any]) -> None:
        record = step_record(step, synced=synced, **fields, **job.fleet.record())
        job.record(record, bar, fields["batch"])
        bar.update(1)

    def write_synced(step: int, fields: dict[str, Any]) -> None:
        """A sync step's record once its sync completed; then, if due, the validation of
        the weights it synced."""
        write(step, pushes.finish(), fields)
        if validation_due(config, step + 1):
            validate(step + 1)

    try:
        pushes.start(job.start_step, request=False)
        pushes.finish()
        if validation_due(config, job.start_step, before=True):
            validate(job.start_step)
        held = job.start_step  # the version the rollout workers hold
        seconds_before = {"paused_s": 0.0, "sync_wait_s": 0.0, "commit_s": 0.0}
        ahead = take(job.start_step)
        for step in range(job.start_step, config.trainer.steps):
            t0 = time.perf_counter()
            got = taken(ahead)
            groups, versions, indices = got["groups"], got["versions"], got["indices"]
            batch, scored, extra = Rollout.concat(groups), None, {}
            if filtering:  # dynamic sampling: more groups from the queue until it is full
                more = _Refill(
                    versions,
                    indices,
                    required,
                    take=lambda count, step=step: taken(take(step, count), count),
                    release=lambda count, step=step: watch.get(
                        queue.release.remote(count, step), timeout=wait_s, what="samples"
                    ),
                )
                batch, scored = fill(config, job.data.reward, batch, more)
                assert scored.kept_groups is not None  # fill() sets it
                versions = [versions[i] for i in scored.kept_groups]
                indices = [indices[i] for i in scored.kept_groups]
                extra = {
                    "gen_batches": scored.gen_batches,
                    "filtered_groups": scored.filtered_groups,
                }
                got["dropped"] += more.dropped  # lagging groups dropped while refilling
            if step + 1 < config.trainer.steps:
                ahead = take(step + 1)  # gathered while this update runs
            # a group of failed agent sessions only holds no token: no version to lag by
            answered = batch.answered().reshape(-1, n).any(dim=1).tolist()
            lags = [step - v for v, a in zip(versions, answered, strict=True) if a]
            t_samples = time.perf_counter()
            result = job.update(batch, mean_lag(lags), scored=scored)
            t_update = time.perf_counter()
            if pending is not None:  # the actor ran that push before this update
                write_synced(*pending)
                pending = None
            started = sync_due(step, trigger, config.trainer.steps)
            if started:
                pushes.start(step + 1)
                held = step + 1
            t_sync = time.perf_counter()
            seconds = {k: got[k] - seconds_before[k] for k in seconds_before}
            seconds_before = {k: got[k] for k in seconds_before}
            fields = {
                "result": result,
                "phases": (t_samples - t0, t_update - t_samples, t_sync - t_update),
                "batch": batch,
                "version": held,
                "lags": lags,
                "group_indices": indices,
                **extra,
                "dropped_samples": got["dropped"] * n,
                "wait_for_samples_s": got["wait_s"],
                "rollout_paused_s": seconds["paused_s"],
                "rollout_sync_wait_s": seconds["sync_wait_s"],
                "rollout_commit_s": seconds["commit_s"],
            }
            due = job.save_due(step + 1)
            if not started:
                write(step, unsynced, fields)
            elif due:  # the record goes before its checkpoint, as in every other step
                write_synced(step, fields)
            else:  # completed while the next step takes its samples and updates
                pending = (step, fields)
            if due:  # the actor saves after its push: the weights of this update
                position = queue.position.remote(step + 1)
                job.save(step + 1, queue=watch.get(position, timeout=wait_s, what="checkpoint"))
            job.export_if_due(step + 1)
        if pending is not None:
            write_synced(*pending)
        steps = config.trainer.steps
        if steps > job.start_step and validation_due(config, steps):  # the final weights
            pushes.start(steps)  # (never synced for training: none is after them)
            pushes.finish()
            validate(steps)
        watch.get(queue.stop.remote(), timeout=wait_s, what="stopping the sample queue")
        watch.loops = []  # their ends are expected now: a worker dead by then is named
        for line in watch.ends(loops, timeout=wait_s, what="stopping the rollout loops"):
            log.warning("%s", line)
    finally:
        ray.kill(queue)
        # No Ray object reference may outlive the run in a reference cycle (heal -> pushes
        # -> watch -> heal): one collected after Ray's shutdown, in Ray's own GC thread,
        # makes Ray end the process (found: a test session ended mid-run with no output).
        pushes.drop()
        watch.heal = None
        watch.loops = []
        job.setup_lost = job.fleet.replace


class _Refill:
    """Dynamic sampling in fully-async mode: :func:`rlwire.trainer.algorithms.scoring.fill`'s
    source of
    more groups. Each call releases the groups dropped since the last (they free their
    places under the staleness bound) and takes the ``missing`` ones from the queue;
    ``versions`` and ``indices`` grow with them, in the order ``fill`` sees the groups."""

    def __init__(self, versions: list, indices: list, required: int, *, take, release) -> None:
        self.versions, self.indices, self.required = versions, indices, required
        self.take, self.release = take, release
        self.released = 0
        self.dropped = 0  # groups the queue dropped for their lag during the refills

    def __call__(self, missing: int) -> Rollout:
        dropped = len(self.versions) - (self.required - missing) - self.released
        self.released += dropped
        self.release(dropped)
        got = self.take(missing)
        self.dropped += got["dropped"]
        self.versions.extend(got["versions"])
        self.indices.extend(got["indices"])
        return Rollout.concat(got["groups"])
