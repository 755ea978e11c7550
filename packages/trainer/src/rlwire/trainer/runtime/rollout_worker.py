"""The rollout worker: one rollout engine in a Ray actor of its own, updated through the
checkpoint engine (colocated mode without the hybrid engine, and fully-async mode)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, cast

import torch

from ..agent.loop import AgentLoop, build_loop
from ..config.root import TrainerConfig
from ..errors import RunError
from ..rollout import (
    Example,
    PartialRolloutEngine,
    Rollout,
    RolloutEngine,
    Sampling,
    SleepingRolloutEngine,
    rollout_engine_class,
)
from .weight_stage import WeightStage
from .worker_process import WorkerProcess, set_threads

__all__ = ["RolloutWorker"]


class RolloutWorker(WeightStage, WorkerProcess):
    """One rollout worker: a generation backend, updated through the checkpoint engine.

    Colocated mode calls :meth:`generate` and :meth:`pull_weights` from the driver;
    fully-async mode calls :meth:`run`, which loops on the sample queue until told to
    stop (see :mod:`rlwire.trainer.modes.fully_async`), and, on the actor's ``receive``
    concurrency group (a thread of its own), :meth:`stage_weights` for each sync: the
    update arrives while the worker generates, and :meth:`run` writes it in at its next
    boundary.
    """

    CONCURRENCY_GROUPS = {"receive": 1}
    """The Ray actor's concurrency groups (``ray.remote(concurrency_groups=...)``): every
    other call runs in order on the default group; :meth:`stage_weights` on ``receive``
    (``.options(concurrency_group="receive")`` at the call)."""

    def __init__(
        self, config: TrainerConfig, model_path: str, index: int = 0, gpu_share: float = 1.0
    ) -> None:
        WorkerProcess.__init__(self, config)
        WeightStage.__init__(self)
        self.model_path = model_path
        self.index = index
        self.gpu_share = gpu_share
        self.backend: RolloutEngine | None = None
        self.engine: Any = None  # the receiver's handle, from the rollout engine's join()
        self.agent: AgentLoop | None = None  # the agent loop (agent.enable)
        self.version = -1

    def load_engine(self) -> None:
        """Build the generation engine on the model (the driver calls it once the model
        directory exists)."""
        engine_class = rollout_engine_class(self.config.rollout.backend)
        # several engines on one GPU split their share (vLLM: gpu_memory_utilization)
        self.backend = backend = engine_class(
            self.config, self.model_path, self.device, gpu_share=self.gpu_share, index=self.index
        )
        model = getattr(backend, "model", None)  # the hf engine's; vLLM's is its own
        if isinstance(model, torch.nn.Module):
            set_threads(self.config, model)
        if self.config.agent.enable:
            self.agent = build_loop(self.config, backend, self.model_path)

    def _loaded(self) -> RolloutEngine:
        """The rollout engine (built by :meth:`load_engine`). Its optional methods (the
        casts below) are called only where its class's flags say it has them: ``sleep``
        and ``wake_up`` (``can_sleep``), ``start`` and ``extend`` (``can_continue``),
        ``stage`` (``stages_updates``)."""
        assert self.backend is not None, f"rollout worker {self.index}: load_engine() first"
        return self.backend

    def engine_init(
        self, backend: str, world_size: int, metadata: dict, rank: int | None = None
    ) -> None:
        """Join the checkpoint engine as a receiver: rank ``rank``, by default ``1 + index``
        (actor rank 0 sends to every rollout worker), through the rollout engine's
        :meth:`~rlwire.trainer.rollout.RolloutEngine.join`."""
        self.engine = self._loaded().join(
            backend,
            rank=1 + self.index if rank is None else rank,
            world_size=world_size,
            metadata=metadata,
        )

    def pull_weights(self) -> dict[str, Any]:
        """Receive one update and apply it; its version and (if configured) the digest."""
        return asyncio.run(self._pull())

    def _pull(self) -> Coroutine[Any, Any, dict[str, Any]]:
        """Receive and apply one update: a coroutine (see
        :meth:`rlwire.trainer.runtime.workers.ActorWorker._push`)."""

        async def receive() -> dict[str, Any]:
            self.version = await self._loaded().apply(self.engine)
            digest = self._loaded().digest() if self.config.ckpt_engine.digest else None
            return {"version": self.version, "digest": digest}

        return receive()

    def sleep(self) -> None:
        """Colocated on GPUs, for a :class:`~rlwire.trainer.rollout.SleepingRolloutEngine`:
        free device memory while the actor trains (the driver asks only then)."""
        cast(SleepingRolloutEngine, self._loaded()).sleep()

    def wake_up(self) -> None:
        cast(SleepingRolloutEngine, self._loaded()).wake_up()

    def generate(
        self, examples: list[Example], seed: int, sampling: Sampling | None = None
    ) -> Rollout:
        """``examples``' samples (``sampling``: other settings than training's: validation),
        stamped with the version held and the call's seconds; multi-turn conversations
        with ``agent.enable``."""
        start = time.perf_counter()
        if self.agent is not None:
            out = self._converse(examples, seed, sampling)
        else:
            prompts = [e.prompt for e in examples]
            args = (prompts, seed) if sampling is None else (prompts, seed, sampling)
            out = self._loaded().generate(*args)  # a third party's engine may take two only
            out.versions = torch.full_like(out.response_ids, self.version)
        _stamp_seconds(out, time.perf_counter() - start)
        return out

    def _converse(
        self,
        examples: list[Example],
        seed: int,
        sampling: Sampling | None,
        chunk: int | None = None,
        between=None,
    ) -> Rollout:
        rollout = self.config.rollout
        if sampling is not None and (
            sampling.greedy or sampling.temperature != rollout.temperature
        ):
            raise RunError(
                "agent.enable: multi-turn rollouts sample at rollout.temperature; validate with "
                f"validation.do_sample=true and validation.temperature={rollout.temperature}"
            )
        n = rollout.n if sampling is None else sampling.n
        assert self.agent is not None, "agent.enable: no agent loop (load_engine() builds it)"
        return self.agent.run(
            examples, n, seed, version=lambda: self.version, chunk=chunk, between=between
        )

    def generate_partial(self, examples: list[Example], seed: int, sync_requested) -> Rollout:
        """Generate in chunks of ``async.partial_rollout_chunk_tokens``; between chunks,
        ``sync_requested()`` applies a weight sync that waits for this worker, if any, and
        the unfinished responses continue with the weights held then. Every token is
        stamped with the version it was sampled with (multi-turn conversations too: a
        conversation may span versions)."""
        cfg = self.config
        chunk = cfg.async_.partial_rollout_chunk_tokens
        start, synced_s = time.perf_counter(), 0.0

        def between() -> None:
            nonlocal synced_s
            began = time.perf_counter()
            sync_requested()  # applies a pending weight update before the next chunk
            synced_s += time.perf_counter() - began

        if self.agent is not None:
            out = self._converse(examples, seed, None, chunk, between)
            _stamp_seconds(out, time.perf_counter() - start - synced_s)
            return out
        backend = cast(PartialRolloutEngine, self._loaded())
        pending = backend.start([e.prompt for e in examples])
        pending.versions = torch.zeros_like(pending.response_ids)
        index = torch.arange(len(pending))  # each pending row's place in the result
        done: dict[int, Rollout] = {}
        left, piece = cfg.rollout.max_new_tokens, 0
        while True:
            before = pending.response_ids.shape[1]
            grown, ended = backend.extend(pending, min(chunk, left), seed + piece * 7_919)
            new = grown.response_ids.shape[1] - before
            stamp = torch.full((len(grown), new), self.version, dtype=torch.int64)
            grown.versions = torch.cat([pending.versions, stamp], dim=1)
            left, piece = left - new, piece + 1
            finished = ended | (left <= 0)
            for row in finished.nonzero().flatten().tolist():
                done[int(index[row])] = grown.select(slice(row, row + 1))
            if bool(finished.all()):
                break
            keep = (~finished).nonzero().flatten()
            pending, index = grown.select(keep), index[keep]
            between()
        out = Rollout.concat([done[i] for i in range(len(done))])
        _stamp_seconds(out, time.perf_counter() - start - synced_s)
        return out

    def run(self, queue, poll_timeout: float = 60.0) -> dict[str, Any]:
        """The fully-async loop: generate, sync, validate or wait as the queue says, until
        ``stop``."""
        import ray

        staged_s = self.config.ckpt_engine.timeout + 30  # the transfer, once requested

        def sync(version: int) -> dict[str, Any]:
            start = time.perf_counter()
            if self._loaded().stages_updates:  # received meanwhile: written in here
                info = self._take_staged(version, staged_s)
            else:
                info = self.pull_weights()
            return {**info, "wait_s": time.perf_counter() - start}

        def sync_if_requested() -> None:
            version = ray.get(queue.sync_pending.remote(self.index), timeout=poll_timeout)
            if version is not None:
                info = sync(version)
                ray.get(queue.worker_synced.remote(self.index, info), timeout=poll_timeout)

        partial = self.config.async_.partial_rollout
        chunks = 0
        report: dict[str, Any] = {}  # what the last task gave, told with the next question
        told = None  # a sync reported while the chunk after it generates
        while True:
            task = ray.get(queue.next_task.remote(self.index, **report), timeout=poll_timeout)
            report = {}
            if told is not None:  # answered long since: surfaces its failure, if any
                ray.get(told, timeout=poll_timeout)
                told = None
            if task["kind"] == "stop":
                return {"worker": self.index, "chunks": chunks, "version": self.version}
            if task["kind"] == "wait":
                continue
            if task["kind"] == "sync":
                info = sync(task["version"])
                if "then" not in task:
                    report = {"synced": info}
                    continue
                told = queue.worker_synced.remote(self.index, info)
                task = task["then"]
            if task["kind"] == "validate":  # held-out prompts, with the weights held
                out = self.generate(task["examples"], task["seed"], task["sampling"])
                ray.get(queue.put_validation.remote(self.index, out), timeout=poll_timeout)
                continue
            if partial:
                out = self.generate_partial(task["examples"], task["seed"], sync_if_requested)
            else:
                out = self.generate(task["examples"], task["seed"])
            n = self.config.rollout.n
            groups = out.groups(n)
            for group, example in zip(groups, task["examples"], strict=True):
                group.examples = [example] * n
            versions = [group.version for group in groups]
            report = {"put": (versions, groups, task["indices"])}
            chunks += 1


def _stamp_seconds(out: Rollout, seconds: float) -> None:
    """A call's ``seconds`` over its samples, evenly (:attr:`Rollout.generate_s`)."""
    out.generate_s = torch.full((len(out),), seconds / max(1, len(out)), dtype=torch.float64)
