"""One job: the Ray workers, scoring and updates, metrics, saves, weight syncs.

Both modes (:mod:`rlwire.trainer.modes.colocated`, :mod:`rlwire.trainer.modes.fully_async`) run
their loop on a :class:`Job`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from rlwire.ckpt_engine import remove_segments

from ..algorithms.advantages import compute_advantages
from ..algorithms.correction import GapWatch
from ..algorithms.micro_batches import rank_shares, row_tokens
from ..algorithms.reward_kl import kl_in_reward
from ..algorithms.scoring import Scored, score
from ..errors import RunError
from ..outputs.checkpoint import save_checkpoint
from ..outputs.export import mark_exported
from ..outputs.metrics import StepMetrics, UpdateMetrics, update_metrics
from ..outputs.rollout_data import write_rollouts
from ..rollout import Rollout, rollout_engine_class, split_evenly
from .cluster import Handle, gpu_layout, placement
from .healing import Fleet
from .hybrid import HybridWorker
from .job_start import JobStart
from .rollout_worker import RolloutWorker
from .senders import merge_reports
from .skipped_steps import SkippedSteps
from .waits import CLOSE_TIMEOUT, RolloutLost, close_workers
from .weight_check import WeightCheck
from .workers import ActorWorker

__all__ = ["Job"]

log = logging.getLogger("rlwire.trainer")


class Job(JobStart):
    """What both modes share: the Ray workers, the metrics file, scoring, updates, saves."""

    def __init__(self, config, run_dir, model_path: str) -> None:
        """Start the worker processes (they import what they need meanwhile; nothing reads
        ``model_path`` before :meth:`start`)."""
        import ray

        self.config, self.run_dir, self.model_path = config, run_dir, model_path
        self.gap = GapWatch(config.algorithm.rollout_correction)
        self.skipped = SkippedSteps(config.agent)  # steps with nothing to train on
        world, workers = config.actor.world_size, config.rollout.num_workers
        self.world = world
        self.hybrid = config.hybrid_engine()  # rollout engines inside the actor ranks
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        layout = gpu_layout(world, 0 if self.hybrid else workers, cluster_gpus, config.trainer.mode)
        # colocated on GPUs, an engine that can sleep frees its memory while the actor
        # trains (nothing to free elsewhere, and nothing while generation overlaps training)
        engine = rollout_engine_class(config.rollout.backend)
        colocated = config.trainer.mode == "colocated"
        self.rollout_sleeps = engine.can_sleep and layout is not None and colocated
        self.namespace = f"rlwire-{os.getpid()}-{int(time.time())}"
        place = placement(layout, config.ray.startup_timeout)
        actor_class = (
            ray.remote(num_cpus=1)(HybridWorker)
            if self.hybrid
            else ray.remote(  # type: ignore[call-overload]  # stub: no concurrency_groups
                num_cpus=1, concurrency_groups=ActorWorker.CONCURRENCY_GROUPS
            )(ActorWorker)
        )
        rollout_class = ray.remote(  # type: ignore[call-overload]  # stub: no concurrency_groups
            num_cpus=1, concurrency_groups=RolloutWorker.CONCURRENCY_GROUPS
        )(RolloutWorker)
        self.actors = [
            actor_class.options(**place("actor", r)).remote(config, model_path, r)
            for r in range(world)
        ]

        def rollout_worker(i: int, restart: int) -> Handle:
            """Rollout worker ``i`` (``restart``: its replacement's number, 0 at the start)."""
            name = f"rollout-{i}" if restart == 0 else f"rollout-{i}-r{restart}"
            return rollout_class.options(
                name=name, namespace=self.namespace, **place("rollout", i)
            ).remote(config, model_path, i, layout.rollout_share(i) if layout else 1.0)

        self.rollouts = (
            self.actors  # each rank generates, with the engine in its process
            if self.hybrid
            else [rollout_worker(i, 0) for i in range(workers)]
        )
        self.members = list(range(len(self.rollouts)))
        """The rollout workers in the checkpoint engine's group, by rank (:mod:`.healing`)."""
        self.fleet = Fleet(self, rollout_worker)
        self.check_weights = WeightCheck()
        self.setup_lost = self.fleet.replace
        # every worker process once
        self.processes = self.actors if self.hybrid else [*self.actors, *self.rollouts]
        self.layout = layout
        self.local_pids: list[int] = []  # the workers on the driver's host (start() sets)

    def start_sync(self, version: int) -> Callable[[], dict[str, Any]]:
        """Start a weight sync, colocated: the actor's weights to every rollout engine as
        ``version``. Returns what waits for it: rank 0's report with each engine's
        (``pulls``). Calls queue on each worker behind those already made. Replacements of
        dead rollout workers join the weight group first; a rollout worker that dies during
        the sync is replaced and the version sent again (:mod:`.healing`)."""
        self.fleet.rejoin()
        members = [self.rollouts[i] for i in self.members]
        if self.rollout_sleeps:
            self.call([r.wake_up.remote() for r in members], "waking the rollout engines")
        if self.hybrid:
            refs = [a.sync_weights.remote(version) for a in self.actors]
        else:
            refs = [
                *[a.push_weights.remote(version) for a in self.actors],
                *[r.pull_weights.remote() for r in members],
            ]

        def done() -> dict[str, Any]:
            # A receiver's failure ends the wait at once with its own error (the sender
            # would only report a timeout, after ckpt_engine.timeout). No overall deadline:
            # the engine bounds every wait of the transfer, and a large model may outlast
            # any fixed budget.
            try:
                reports = self.watch.get(refs, timeout=None, what="weight sync")
            except RolloutLost as lost:
                self.fleet.replace(lost)  # (or the line that stops the run, at once)
                self.abort_push(lost)  # the sender and the survivors stop waiting for it
                self.settle(refs, lost)  # while the replacement loads
                return self.start_sync(version)()
            if self.hybrid:
                report = {**merge_reports(reports), "pulls": [r["pull"] for r in reports]}
                self.check_weights(report, version)
                return report
            pushes, pulls = reports[: len(self.actors)], reports[len(self.actors) :]
            return self.sync_report(pushes, pulls, version)

        return done

    _delta_reason: str | None = None
    """The last reason ``ckpt_engine.delta=auto`` gave for sending dense (logged once)."""

    def sync_report(self, pushes: list[dict], pulls: list[dict], version: int) -> dict[str, Any]:
        """The actor ranks' push reports of ``version`` as one (:func:`~.senders.merge_reports`),
        with each rollout worker's pull report (``pulls``), compared with the actor's when
        they carry digests (:class:`~.weight_check.WeightCheck`: a RunError when an engine's
        differ); where a pull names the processes whose
        shared memory it read from (``source_pids``), ``weight_sources``: the actor ranks
        they are, by pull. Why ``ckpt_engine.delta=auto`` sends dense is logged once per
        reason, not recorded per step: a re-formed group (a healed worker) decides afresh,
        so the field would differ between runs that trained the same weights."""
        report = {**merge_reports(pushes), "pulls": pulls}
        reason = report.pop("weight_sync_delta_reason", None)
        if reason is not None and reason != self._delta_reason:
            self._delta_reason = reason
            log.info("ckpt_engine.delta=auto sends dense: %s", reason)
        if pulls and all(p.get("source_pids") is not None for p in pulls):
            ranks = {pid: rank for rank, pid in enumerate(self.actor_pids)}
            report["weight_sources"] = [
                sorted(ranks.get(pid, -1) for pid in p["source_pids"]) for p in pulls
            ]
        self.check_weights(report, version)
        return report

    def abort_push(self, lost: RolloutLost) -> None:
        """End the weight send in progress at once on every sending actor rank and every
        receiver (the checkpoint engine's ``abort``), instead of the ``ckpt_engine.timeout``
        a sender would wait for the dead worker; the groups are re-formed before the next
        send."""
        reason = f"rollout worker {lost.index} died"
        calls = [
            a.abort_push.options(concurrency_group="abort").remote(reason) for a in self.actors
        ]
        self.watch.get(calls, timeout=self.config.ckpt_engine.timeout, what="aborting the sync")

    def settle(self, refs: list, lost: RolloutLost) -> None:
        """Wait until every call of a sync that lost a member has ended (each of their
        waits is bounded by ``ckpt_engine.timeout``), whatever their outcome; ``lost`` is
        raised if they do not end."""
        import ray

        bound = self.config.ckpt_engine.timeout + 60
        _, left = ray.wait(refs, num_returns=len(refs), timeout=bound)
        if left:
            raise RunError(
                f"{lost} (the other members of the sync did not stop within {bound:g} s)"
            )

    def sync(self, version: int) -> dict[str, Any]:
        """One weight sync, colocated (see :meth:`start_sync`)."""
        return self.start_sync(version)()

    def start_generation(self, step: int) -> Callable[[], Rollout]:
        """Start generating step ``step``'s batch: the data's batch ``step``, moved on by the
        extra batches dynamic sampling took, ``rollout.n`` samples of each prompt, the
        prompts split over the rollout engines. Returns what waits for it (with the
        samples' ``examples``; on GPUs the engines are asleep after it). A rollout worker
        that dies meanwhile is replaced and its share generated again (:mod:`.healing`)."""
        config = self.config
        position = step + self.extra_batches  # the data's batch (and the seeds) to generate
        examples = self.data.batches(position)
        shares = split_evenly(examples, len(self.rollouts))
        seeds = [_seed(config, position, i) for i in range(len(shares))]

        def redo(share: int, worker: int):
            return self.rollouts[worker].generate.remote(shares[share], seeds[share])

        workers = self.fleet.assign(len(shares))  # one still joining: another does its share
        refs = {i: redo(i, workers[i]) for i, part in enumerate(shares) if part}

        def named(index: int, share: int, by: int | None) -> None:
            first = sum(len(s) for s in shares[:share])
            span = range(first, first + len(shares[share]))
            self.fleet.regenerating(index, span, by, position)

        def done() -> Rollout:
            parts = self.healed(refs, redo, named, "generation")
            batch = Rollout.concat([parts[i] for i in sorted(parts)])
            batch.examples = [e for e in examples for _ in range(config.rollout.n)]
            if self.rollout_sleeps:  # colocated on GPUs: free the engines' memory for the update
                sleeps = [self.rollouts[i].sleep.remote() for i in self.fleet.present]
                self.call(sleeps, "putting the rollout engines to sleep")
            return batch

        return done

    def healed(
        self,
        refs: dict[int, Any],
        redo: Callable[[int, int], Any],
        named: Callable[[int, int, int | None], None],
        what: str,
    ) -> dict[int, Any]:
        """Each share's result (``refs``: share -> its call; share ``i`` is worker ``i``'s,
        or another's while ``i`` joins). The share of a worker that died is made again by
        one that lived through the call (same weights; ``redo(share, worker)`` makes the
        call, with the share's own seed), or, with none left, by the replacement once it
        holds the actor's weights; ``named(dead worker, share, by)`` logs it (``by`` None:
        the replacement)."""
        if not self.fleet.heals:  # the first failure stops the run
            return dict(zip(refs, self.call(list(refs.values()), what), strict=True))
        out: dict[int, Any] = {}
        todo = dict(refs)
        while todo:
            lost: dict[int, RolloutLost] = {}
            for share, ref in todo.items():
                try:
                    out[share] = self.watch.get(ref, timeout=self.task_timeout, what=what)
                except RolloutLost as err:
                    lost[share] = err
            dead = {lost_one.index: lost_one for lost_one in lost.values()}
            for lost_one in dead.values():
                self.fleet.replace(lost_one)
            joining = self.fleet.joining
            holders = [i for i in range(len(self.rollouts)) if i not in dead and i not in joining]
            replaced = not holders  # the replacements take the actor's weights first
            if replaced and lost:
                self.fleet.rejoin()
                self.sync(self.next_update)
                holders = self.fleet.present
            todo = {}
            for k, share in enumerate(sorted(lost)):
                by = holders[k % len(holders)]
                named(lost[share].index, share, None if replaced else by)
                todo[share] = redo(share, by)
        return out

    def generate_more(self, step: int, missing: int = 0) -> Rollout:
        """Dynamic sampling: the data's next batch, generated now for step ``step`` (the data
        position moves on by one batch for the rest of the run; a whole batch whatever
        ``missing``, as verl generates). Sleeping engines (colocated on GPUs) are woken first:
        the generation before this one put them to sleep."""
        self.extra_batches += 1
        if self.rollout_sleeps:
            wakes = [self.rollouts[i].wake_up.remote() for i in self.fleet.present]
            self.call(wakes, "waking the rollout engines")
        return self.start_generation(step)()

    def call(self, refs, what: str):
        """Wait for calls to the workers, bounded by ``ray.task_timeout``; a failed or dead
        worker stops the run at once with one line naming the call."""
        return self.watch.get(refs, timeout=self.task_timeout, what=what)

    def close(self) -> None:
        """Close every rollout engine, then end every worker process without interpreter
        finalization.

        Each rollout engine's own ``close`` runs first, in its worker (its core's thread,
        vLLM's adapter directories, a ``vllm serve`` process: what nothing removes after a
        kill), :data:`~rlwire.trainer.runtime.waits.CLOSE_TIMEOUT` seconds at most for all
        of them (a dead worker's close fails at once; a stuck one's is given up at the end
        of it); a close that fails or times out is a warning in the log. Then ``ray.kill``
        exits every process at once. A normal exit would finalize the interpreter while the
        process group's gloo worker threads may still be dropping Python references, which
        aborts the process ("terminate called without an active exception"). Everything the
        run produced is written by the time this is called.
        """
        if self.hybrid:  # each rank's engine in the rank's process
            closes = [(f"actor rank {i}", a.close.remote()) for i, a in enumerate(self.actors)]
        else:  # on a group of its own: fully async's loop may still hold the default one
            closes = [
                (f"rollout worker {i}", r.close.options(concurrency_group="close").remote())
                for i, r in enumerate(self.rollouts)
            ]
        for line in close_workers(self.processes, closes, timeout=CLOSE_TIMEOUT):
            log.warning("closing the job: %s", line)
        # An engine killed before every receiver mapped its shared memory (a run stopped
        # mid-sync) never unlinked it: remove what this host's workers left, once they exit.
        remove_segments(self.local_pids, wait=10.0)

    def update(
        self, batch: Rollout, lag: float = 0.0, scored: Scored | None = None
    ) -> UpdateMetrics:
        """Score ``batch`` and run the update (see :meth:`start_update`)."""
        return self.start_update(batch, lag, scored)()

    def start_update(
        self,
        batch: Rollout,
        lag: float = 0.0,
        scored: Scored | None = None,
        *,
        sync_follows: bool = False,
    ) -> Callable[[], UpdateMetrics]:
        """Score ``batch`` (with its ``examples``; unless ``scored`` already: dynamic
        sampling), compute advantages and start the update
        on every actor rank, each on its shard (``actor.ppo_mini_batch_size`` and
        ``actor.ppo_epochs`` set its optimizer steps); ``lag``: the samples' mean version
        lag behind the weights updated (the staleness-aware step size); ``sync_follows``:
        the actors' next call sends the weights (with ``actor.offload`` the model stays on
        the device for it). Returns what waits for it."""
        n, algorithm = self.config.rollout.n, self.config.algorithm
        scored = score(self.config, self.data.reward, batch) if scored is None else scored
        if not bool(batch.response_mask.any()):  # nothing to train on: skipped, counted
            skipped = self.skipped.skip(batch, scored)
            return lambda: skipped
        self.skipped.trained()
        rewards, reward_extra, reward_s = scored.rewards, scored.extra, scored.seconds
        batch.rewards = rewards
        penalised = rewards
        if algorithm.use_kl_in_reward:  # the actor's and the reference's log-probs first
            penalised, reward_extra = kl_in_reward(self, batch, rewards, reward_extra)
        batch.advantages = compute_advantages(algorithm, penalised, batch.response_mask, n)
        # The actors need tensors only: the strings stay here.
        tensors = dataclasses.replace(batch, texts=[], examples=[], trajectories=None)
        if self.config.trainer.balance_batch and self.world > 1:  # equal tokens per rank
            lengths = row_tokens(tensors.prompt_mask, tensors.response_mask)
            shares = rank_shares(lengths, self.world)
            shards = [tensors.select(torch.tensor(rows)) for rows in shares]
        else:
            shards = [tensors.shard(r, self.world) for r in range(self.world)]
        step, self.next_update = self.next_update, self.next_update + 1
        refs = [
            a.train.remote(s, lag, step, sync_follows)
            for a, s in zip(self.actors, shards, strict=True)
        ]

        def done() -> UpdateMetrics:
            results = self.call(refs, "update")
            metrics = update_metrics(batch, rewards, reward_extra, reward_s, results)
            self.skipped.trained(metrics)
            return metrics

        return done

    def record(self, metrics: StepMetrics, bar, batch: Rollout) -> None:
        """A step's line of ``metrics.jsonl``, in the log and to every logger (and its
        samples in ``trainer.rollout_data_dir``); a warning line when the off-policy gap
        outgrows the correction (:class:`GapWatch`)."""
        self._write(metrics.to_json(), f"step {metrics.step}")
        if self.config.trainer.rollout_data_dir is not None:
            write_rollouts(
                self.config.trainer.rollout_data_dir, metrics.step, batch, self.config.rollout.n
            )
        bar.set_postfix(reward=f"{metrics.reward_mean:.3f}")
        warning = self.gap.observe(
            metrics.step, metrics.rollout_is_truncated_fraction, metrics.kl_behaviour_proximal
        )
        if warning is not None:
            log.warning("%s", warning)
            print(f"rlwire-train: warning: {warning}", file=sys.stderr)

    def validate(self, done: int, waiting: Callable[[], dict[str, float]]) -> None:
        """Wait for a validation of the weights after ``done`` updates (queued earlier) and
        record it: a ``val/...`` line of ``metrics.jsonl``, the log and every logger."""
        self._write({"step": done, **waiting()}, f"validation after {done} updates")

    def _write(self, values: dict[str, Any], what: str) -> None:
        line = json.dumps(values)
        with self.metrics_path.open("a") as f:
            f.write(line + "\n")
        log.info("%s %s", what, line)
        for tracker in self.trackers:
            tracker.log(values, values["step"])

    def export_model(self) -> None:
        """The final policy as a Hugging Face directory, ``hf_model/`` in the run directory
        (merged, with LoRA; the adapter in PEFT's format in ``adapter/``)."""
        target = str(self.run_dir / "hf_model")
        adapter = str(self.run_dir / "adapter") if self.config.actor.lora.enabled else None
        self.call([a.export_hf.remote(target, adapter) for a in self.actors], "writing hf_model")
        mark_exported(self.run_dir, self.config.trainer.steps)  # complete: the loop ran to it

    def save_due(self, done: int) -> bool:
        """Whether a checkpoint is written after ``done`` updates."""
        every, last = self.config.trainer.save_every, self.config.trainer.steps
        return bool(every and done % every == 0) or done == last

    def save(self, done: int, **state: Any) -> None:
        """Checkpoint ``checkpoints/step_<done>`` (see
        :func:`rlwire.trainer.outputs.checkpoint.save_checkpoint`); ``state``: the mode's own part
        of
        ``trainer_state.json``."""
        kl = self.kl_ctrl.value
        save_checkpoint(self, done, extra_batches=self.extra_batches, kl_ctrl_value=kl, **state)

    def save_if_due(self, done: int) -> None:
        if self.save_due(done):
            self.save(done)
        self.export_if_due(done)

    def export_if_due(self, done: int) -> None:
        """``hf_models/step_<done>``, a Hugging Face folder of the weights after ``done``
        updates, every ``trainer.save_hf_every`` updates (``hf_model/`` is the last's)."""
        every = self.config.trainer.save_hf_every
        if every and done % every == 0:
            target = self.run_dir / "hf_models" / f"step_{done}"
            target.parent.mkdir(exist_ok=True)
            refs = [a.export_hf.remote(str(target), None) for a in self.actors]
            self.call(refs, f"writing hf_models/{target.name}")


def _seed(config, step: int, worker: int) -> int:
    """Rollout worker ``worker``'s sampling seed at ``step``."""
    return config.trainer.seed * 7919 + step + worker * 1_000_003
