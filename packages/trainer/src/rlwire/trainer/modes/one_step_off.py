"""One-step off-policy mode (verl's ``one_step_off_policy`` recipe): the next batch is
generated with the previous weights while the update runs.

Step ``t`` trains on the batch generated with weights ``v(t-1)`` (the first step of a run,
or of a resumed run, on one generated with the weights it starts from), while the rollout
workers generate batch ``t+1`` with ``v(t)``; then the new weights ``v(t+1)`` go to them,
between steps. Every sample after the first batch is exactly one version stale, and nothing
depends on timing: each worker runs its calls in the order they were made (a generation
before the weights that follow it), the sampling seeds are those of colocated mode, so two
runs with one seed give the same metrics. The off-policy correction's ``auto`` is on
(token-level truncated IS, as in fully-async mode).
"""

from __future__ import annotations

import functools
import time

from ..algorithms.scoring import fill
from ..outputs.metrics import mean_lag, step_record
from ..rollout import Rollout
from ..runtime.job import Job
from ..runtime.validation import start_validation, validation_due

__all__ = ["run_one_step_off", "sample_lags"]


def sample_lags(step: int, batch: Rollout) -> list[int]:
    """How many versions each sample of ``batch`` that holds a response token lags
    ``step`` (by the versions the workers stamped); none for a batch of failed agent
    sessions only, which is skipped, not trained."""
    return (step - batch.sample_versions()).tolist()


def run_one_step_off(job: Job, bar) -> None:
    """Train step ``t`` on the batch of ``v(t-1)`` while batch ``t+1`` is generated with
    ``v(t)``; sync ``v(t+1)`` between steps.

    A rollout worker generates batch ``t+1`` while the actor ranks train on batch ``t``;
    once both are done the actor sends ``v(t+1)`` to the rollout workers (the sync starts
    only then, so that a rollout worker that died during the generation is replaced and
    its share generated again with ``v(t)`` first: :mod:`rlwire.trainer.runtime.healing`).
    The driver waits for the update, then for the overlapped generation, then for the
    sync; the step's times are those three waits (``time_rollout_s`` is the generation
    that the update did not hide)."""
    config = job.config
    steps = config.trainer.steps
    filtering = config.fills_batches()
    job.sync(job.start_step)  # the rollout engines start from the actor's (maybe resumed) weights
    if validation_due(config, job.start_step, before=True):
        job.validate(job.start_step, start_validation(job, job.data.validation))
    following = job.start_generation(job.start_step)
    batch = following()
    for step in range(job.start_step, steps):
        t0 = time.perf_counter()
        scored, extra = None, {}
        if filtering:  # dynamic sampling: more batches with the weights held now (v(step))
            more = functools.partial(job.generate_more, step)
            batch, scored = fill(config, job.data.reward, batch, more)
            extra = {"gen_batches": scored.gen_batches, "filtered_groups": scored.filtered_groups}
        lags = sample_lags(step, batch)
        last = step + 1 == steps
        update = job.start_update(batch, mean_lag(lags), scored=scored, sync_follows=not last)
        held_out = None
        if not last:  # generated with v(step), which the rollout workers hold now
            following = job.start_generation(step + 1)
        result = update()
        t_update = time.perf_counter()
        synced: dict = {"weight_sync_gbps": 0.0, "pulls": []}
        trained = batch
        if not last:  # the sync starts once the batch is in: a worker lost meanwhile is
            batch = following()  # replaced and its share generated with v(step) again
        t_samples = time.perf_counter()
        if not last:
            synced = job.sync(step + 1)
            if validation_due(config, step + 1):  # v(step + 1), before batch step + 2
                held_out = start_validation(job, job.data.validation)
        t_sync = time.perf_counter()
        record = step_record(
            step,
            result,
            (t_samples - t_update, t_update - t0, t_sync - t_samples),
            synced,
            batch=trained,
            version=step if last else step + 1,
            lags=lags,
            **extra,
            **job.fleet.record(),
        )
        job.record(record, bar, trained)
        bar.update(1)
        if last and validation_due(config, step + 1):  # the last weights reach the engines
            job.sync(step + 1)  # only to be validated
            held_out = start_validation(job, job.data.validation)
        if held_out is not None:
            job.validate(step + 1, held_out)
        job.save_if_due(step + 1)
