"""Colocated mode: generate, update, sync; every sample comes from the weights being updated."""

from __future__ import annotations

import time

from .config import TrainerConfig
from .job import Job
from .rollout import Rollout

__all__ = ["run_colocated"]


def run_colocated(job: Job, bar) -> None:
    """Generate, update, sync: every sample comes from the weights being updated."""
    config = job.config
    n, workers = config.rollout.n, len(job.rollouts)
    watch = job.watch

    def sync(version: int) -> dict:
        if job.rollout_sleeps:
            job.call([r.wake_up.remote() for r in job.rollouts], "waking the rollout engines")
        pushed = [a.push_weights.remote(version) for a in job.actors]
        pulled = [r.pull_weights.remote() for r in job.rollouts]
        # A receiver's failure ends the wait at once with its own error (the sender would
        # only report a timeout, after ckpt_engine.timeout). No overall deadline: the engine
        # bounds every wait of the transfer, and a large model may outlast any fixed budget.
        done = watch.get([*pushed, *pulled], timeout=None, what="weight sync")
        return {**done[0], "pulls": done[len(pushed) :]}

    sync(job.start_step)  # the rollout workers start from the actor's (maybe resumed) weights
    for step in range(job.start_step, config.trainer.steps):
        t0 = time.perf_counter()
        examples = job.batches(step)
        prompts = [e.prompt for e in examples]
        share = -(-len(prompts) // workers)
        parts = job.call(
            [
                r.generate.remote(prompts[i * share : (i + 1) * share], _seed(config, step, i))
                for i, r in enumerate(job.rollouts)
                if prompts[i * share : (i + 1) * share]
            ],
            "generation",
        )
        batch = Rollout.concat(parts)
        batch.examples = [e for e in examples for _ in range(n)]
        if job.rollout_sleeps:  # colocated on GPUs: free the engine's memory for the update
            job.call(
                [r.sleep.remote() for r in job.rollouts], "putting the rollout engines to sleep"
            )
        t_rollout = time.perf_counter()
        result = job.update(batch)
        t_update = time.perf_counter()
        synced = sync(step + 1)
        t_sync = time.perf_counter()
        record = job.step_record(
            step,
            result,
            (t0, t_rollout, t_update, t_sync),
            synced,
            samples=len(prompts) * n,
            version=step + 1,
            lags=[0],
        )
        job.record(record, bar)
        bar.update(1)
        job.save_if_due(step + 1)


def _seed(config: TrainerConfig, step: int, worker: int) -> int:
    return config.trainer.seed * 7919 + step + worker * 1_000_003
