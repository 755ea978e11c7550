"""The rollout worker: one rollout engine in a Ray actor of its own, updated through the
checkpoint engine (colocated mode without the hybrid engine, and fully-async mode)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Coroutine
from typing import Any, cast

import torch

from ..agent.function import FunctionRunner
from ..agent.loop import AgentLoop, build_loop
from ..config.root import TrainerConfig
from ..errors import RunError
from ..rollout import (
    Example,
    Rollout,
    RolloutEngine,
    Sampling,
    SleepingRolloutEngine,
    rollout_engine_class,
)
from .rollout_serve import ServeLoop, generate_requests, stamp_seconds
from .weight_stage import WeightStage
from .worker_process import WorkerProcess, set_threads

__all__ = ["RolloutWorker"]


class RolloutWorker(WeightStage, WorkerProcess):
    """One rollout worker: a generation backend, updated through the checkpoint engine.

    Colocated mode calls :meth:`generate` and :meth:`pull_weights` from the driver;
    fully-async mode calls :meth:`run`, which loops on the sample queue until told to
    stop (see :mod:`rlwire.trainer.modes.fully_async`), and, on the actor's ``receive``
    concurrency group (a thread of its own), :meth:`stage_weights` for each sync: the
    update arrives while the worker generates, and :meth:`run` writes it in between two
    decoding steps (:class:`~rlwire.trainer.runtime.rollout_serve.ServeLoop`).
    """

    CONCURRENCY_GROUPS = {"receive": 1, "close": 1}
    """The Ray actor's concurrency groups (``ray.remote(concurrency_groups=...)``): every
    other call runs in order on the default group; :meth:`stage_weights` on ``receive``
    and :meth:`close` on ``close`` (``.options(concurrency_group=...)`` at the call)."""

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
        self.agent: AgentLoop | FunctionRunner | None = None  # the agent loop (agent.enable)
        self.version = -1

    def load_engine(self, weight_backend: str | None = None, rejoin: bool = False) -> None:
        """Build the generation engine on the model (the driver calls it once the model
        directory exists). ``weight_backend``: the checkpoint engine's backend as the driver
        resolved it (``ckpt_engine.backend=auto`` by where the workers run), in the config
        the engine is given (a ``vllm serve`` server is started with its engine);
        ``rejoin``: this worker replaces a lost one (for an engine that
        :attr:`~rlwire.trainer.rollout.RolloutEngine.rejoins`)."""
        if weight_backend is not None and weight_backend != self.config.ckpt_engine.backend:
            section = dataclasses.replace(self.config.ckpt_engine, backend=weight_backend)
            self.config = dataclasses.replace(self.config, ckpt_engine=section)
        engine_class = rollout_engine_class(self.config.rollout.backend)
        # several engines on one GPU split their share (vLLM: gpu_memory_utilization)
        extra = {"rejoin": True} if rejoin and engine_class.rejoins else {}
        self.backend = backend = engine_class(
            self.config,
            self.model_path,
            self.device,
            gpu_share=self.gpu_share,
            index=self.index,
            **extra,
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
        :meth:`~rlwire.trainer.rollout.RolloutEngine.join`; a group joined before (one
        re-formed: :mod:`.healing`) is left first, and an update it staged and nobody wrote
        in is dropped."""
        from rlwire.ckpt_engine import CheckpointEngine

        if isinstance(self.engine, CheckpointEngine):
            self.engine.finalize()
        self._drop_staged()  # the old group's: the re-formed one sends afresh
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
            return self._held()

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
            if out.versions is None:  # a request engine's record each token's version
                out.versions = torch.full_like(out.response_ids, self.version)
        stamp_seconds(out, time.perf_counter() - start)
        return out

    def _converse(self, examples: list[Example], seed: int, sampling: Sampling | None) -> Rollout:
        return asyncio.run(self.conversations(examples, seed, sampling))

    def conversations(self, examples: list[Example], seed: int, sampling: Sampling | None):
        """The agent loop's conversations of ``examples``: a coroutine (no method of this
        class is ``async``: Ray would make the whole actor an asyncio one)."""
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
        return self.agent.run_async(examples, n, seed)

    def generate_requests(self, examples: list[Example], seed: int) -> Rollout:
        """``examples``' training samples as fully async makes them: requests to the engine,
        all in flight at once, each token stamped with the version that sampled it."""
        return asyncio.run(generate_requests(self, examples, seed))

    def sync(self, version: int) -> dict[str, Any]:
        """Write in update ``version`` between two decoding steps: the one
        :meth:`stage_weights` received meanwhile, or (an engine that cannot stage) received
        now, the engine held between two steps for the transfer. Its version and digest."""
        backend = self._loaded()
        if backend.stages_updates:
            return self._take_staged(version, self.config.ckpt_engine.timeout)
        return backend.between_steps(self.pull_weights)

    def close(self) -> None:
        """Close the rollout engine (:meth:`~rlwire.trainer.rollout.RolloutEngine.close`)
        and the agent function's endpoint: the job calls it before it kills this process,
        after which no finalizer runs. On the ``close`` group, beside a call that may still
        run (fully async's :meth:`run`, which then ends with the engine's error)."""
        if isinstance(self.agent, FunctionRunner):
            self.agent.close()
        if self.backend is not None:
            self.backend.close()

    def run(self, queue, poll_timeout: float = 60.0) -> dict[str, Any]:
        """The fully-async loop (:class:`~rlwire.trainer.runtime.rollout_serve.ServeLoop`):
        generate, sync, validate or wait as the queue says, until ``stop``."""
        return asyncio.run(ServeLoop(self, queue, poll_timeout).serve())
