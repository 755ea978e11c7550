"""Colocated mode: generate, update, sync; every sample comes from the weights being updated."""

from __future__ import annotations

import functools
import time

from ..algorithms.scoring import fill
from ..outputs.metrics import step_record
from ..runtime.job import Job
from ..runtime.validation import start_validation, validation_due

__all__ = ["run_colocated"]


def run_colocated(job: Job, bar) -> None:
    """Generate, update, sync: every sample comes from the weights being updated.

    The update and the sync are made together (each actor rank runs them in order); the
    next step's generation once the sync is complete, so that a rollout worker lost in the
    sync is replaced, and holds the new weights, before anything generates
    (:mod:`rlwire.trainer.runtime.healing`); the driver records the step while the next
    batch is generated. With dynamic
    sampling (``algorithm.filter_groups``) the batch is scored first and filled up with more
    generation batches (the rollout engines hold the weights being updated). Validation
    (:mod:`rlwire.trainer.runtime.validation`) is queued between a sync and the next generation and
    left out of the steps' times. The times are
    the driver's: from the end of the previous sync to the samples, to the end of the
    update, to the end of the sync.
    """
    config = job.config
    steps = config.trainer.steps
    filtering = config.fills_batches()
    job.sync(job.start_step)  # the rollout engines start from the actor's (maybe resumed) weights
    held_out = None
    if validation_due(config, job.start_step, before=True):
        held_out = start_validation(job, job.data.validation)
    following = job.start_generation(job.start_step) if job.start_step < steps else None
    if held_out is not None:
        job.validate(job.start_step, held_out)
    t0 = time.perf_counter()
    for step in range(job.start_step, steps):
        assert following is not None  # started for every step of the range
        batch = following()
        scored, extra = None, {}
        if filtering:  # dynamic sampling: more batches, same weights, until it is full
            more = functools.partial(job.generate_more, step)
            batch, scored = fill(job.config, job.data.reward, batch, more)
            extra = {
                "gen_batches": scored.gen_batches,
                "filtered_groups": scored.filtered_groups,
            }
        t_rollout = time.perf_counter()
        update = job.start_update(batch, scored=scored, sync_follows=True)
        # Sleeping engines (GPUs) wake only once the update has freed the device.
        early = update() if job.rollout_sleeps else None
        sync = job.start_sync(step + 1)
        result = early if early is not None else update()
        t_update = time.perf_counter()
        synced = sync()
        t_sync = time.perf_counter()
        # validation: between the sync and the next generation on every rollout engine;
        # both once the sync is complete (a worker lost in it is replaced first)
        due = validation_due(config, step + 1)
        held_out = start_validation(job, job.data.validation) if due else None
        following = job.start_generation(step + 1) if step + 1 < steps else None
        record = step_record(
            step,
            result,
            (t_rollout - t0, t_update - t_rollout, t_sync - t_update),
            synced,
            batch=batch,
            version=step + 1,
            lags=[0],
            **extra,
            **({} if job.hybrid else job.fleet.record()),
        )
        t0 = t_sync
        job.record(record, bar, batch)
        bar.update(1)
        if held_out is not None:
            job.validate(step + 1, held_out)
            t0 = time.perf_counter()  # the next step's time leaves the validation out
        job.save_if_due(step + 1)
