"""The rollout-engine seam: what a rollout worker needs from ``hf``, ``vllm`` or a third party.

A :class:`RolloutEngine` holds a copy of the policy in a rollout worker's process: it
samples responses with the log-probability of every sampled token under the sampling
distribution (the behaviour policy), applies weight updates that arrive through a
checkpoint engine, and hashes its weights for checks. Freeing device memory between
phases is a declared capability (:attr:`RolloutEngine.can_sleep`), not a method probed
for.

Engines are chosen by ``rollout.backend``: a name from :data:`ROLLOUT_ENGINES` or a
dotted path ``package.module:Class`` to a subclass, imported in every rollout worker.
"""

from __future__ import annotations

import abc
import concurrent.futures
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch

from ..plugins import load_class
from .common import Rollout, Sampling
from .requests import EngineCore, Request, sample_requests, wait_all
from .tokens import completions_rollout, continuation_rows, token_rollout

__all__ = [
    "ROLLOUT_ENGINES",
    "EngineLost",
    "PartialRolloutEngine",
    "RequestsEngine",
    "RolloutEngine",
    "SleepingRolloutEngine",
    "StagingRolloutEngine",
    "rollout_engine_class",
]

T = TypeVar("T")

CLOSE_TIMEOUT = 5.0
"""Seconds :meth:`RolloutEngine.close` waits for its core's step in progress."""


class EngineLost(RuntimeError):
    """The engine of rollout worker ``index`` is gone while its process lives: the server it
    drives stopped answering. The job heals it as a dead worker (:mod:`rlwire.trainer.runtime.
    healing`): the worker is replaced, and the replacement waits for the server to answer
    again (:attr:`RolloutEngine.rejoins`)."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


ROLLOUT_ENGINES: dict[str, str] = {
    "hf": "rlwire.trainer.rollout.hf:HFEngine",
    "paced": "rlwire.trainer.rollout.paced:PacedEngine",
    "vllm": "rlwire.trainer.rollout.vllm:VLLMEngine",
    "vllm_server": "rlwire.trainer.rollout.vllm_server:VLLMServerEngine",
}


class RolloutEngine(abc.ABC):
    """A generation backend in one rollout worker.

    Args:
        config: the whole :class:`rlwire.trainer.config.root.TrainerConfig`.
        model_path: a Hugging Face model directory (the initial weights).
        device: this worker's device.
        gpu_share: the fraction of its GPU this engine may use (several engines can share one).
        index: this rollout worker's index (``0 .. rollout.num_workers - 1``).
    """

    name: ClassVar[str] = ""
    can_sleep: ClassVar[bool] = False
    """Whether the engine frees device memory on request (:class:`SleepingRolloutEngine`);
    the driver asks for it only then, and only colocated on GPUs."""
    can_continue: ClassVar[bool] = False
    """Whether the engine continues unfinished responses (:class:`PartialRolloutEngine`),
    which ``async.partial_rollout`` needs."""
    hybrid: ClassVar[bool] = False
    """Whether the engine can run inside an actor rank's process (``rollout.hybrid_engine``),
    next to the training engine and its process group."""
    takes_deltas: ClassVar[bool] = False
    """Whether ``apply`` passes the version it holds, so that a checkpoint engine with
    ``delta`` on may send only what changed (``ckpt_engine.delta=auto`` is off otherwise)."""
    stages_updates: ClassVar[bool] = False
    """Whether the engine receives an update while it generates and writes it in later
    (:class:`StagingRolloutEngine`); fully-async mode then never holds a worker's
    generation for a transfer, only for the write at a boundary."""
    serves_requests: ClassVar[bool] = False
    """Whether the engine batches requests continuously (its own :attr:`core`: requests join
    and leave between two decoding steps, each with its own seed). Otherwise
    :meth:`submit` is a layer over ``extend`` (:class:`PartialRolloutEngine`;
    :mod:`.lockstep`): the live requests are one call per step, with one seed."""
    takes_lora: ClassVar[bool] = False
    """Whether the engine holds ``actor.lora``'s adapters over the base weights and applies
    a sync of the adapter alone (by :func:`rlwire.trainer.models.lora.adapter_name`)."""
    rejoins: ClassVar[bool] = False
    """Whether the engine takes ``rejoin=True`` (a keyword of its constructor) when it is
    built to replace a lost one of the same index, and may take long to load then:
    ``vllm_server`` starts a server (minutes), or waits, with backoff, for a server given
    by URL to answer again and takes it back holding this run's weights
    (:class:`EngineLost`). Lock-step syncs go on without such a replacement until it
    loaded (:mod:`rlwire.trainer.runtime.healing`)."""

    def __init__(
        self,
        config,
        model_path: str,
        device: torch.device,
        *,
        gpu_share: float = 1.0,
        index: int = 0,
    ) -> None:
        self.config = config
        self.index = index

    @abc.abstractmethod
    def generate(self, prompts: list[str], seed: int, sampling: Sampling | None = None) -> Rollout:
        """``rollout.n`` samples per prompt (consecutive) as a :class:`Rollout` of host
        tensors: token ids, masks, behaviour log-probs (temperature applied), texts and
        ``pad_id`` (the worker stamps ``versions``). ``sampling``: other settings for this
        call (validation), else ``rollout``'s; an engine that cannot honour it raises."""

    def join(self, backend: str, *, rank: int, world_size: int, metadata: dict):
        """Join the checkpoint-engine group as receiver ``rank``; the handle that
        :meth:`apply` (and :meth:`StagingRolloutEngine.stage`) are given. By default an
        rlwire receiver in this process; an engine whose weights live in processes of its
        own may have those join instead (``vllm``: its weight-transfer engine)."""
        from rlwire.ckpt_engine import registry

        cfg = self.config.ckpt_engine
        engine = registry.new(backend, bucket_size=cfg.bucket_size, timeout=cfg.timeout)
        engine.prepare()
        engine.init_process_group(rank=rank, world_size=world_size, master_metadata=metadata)
        return engine

    @abc.abstractmethod
    async def apply(self, engine) -> int:
        """Receive one update from the checkpoint ``engine`` (what :meth:`join` returned)
        into the weights; its version."""

    core: EngineCore | None = None
    """The engine core that serves this engine's requests (:mod:`.requests`): an engine
    with continuous batching sets its own in ``__init__``; otherwise a lock-step core over
    ``extend`` is built on the first request (:class:`PartialRolloutEngine` only)."""

    def submit(self, request: Request) -> concurrent.futures.Future:
        """Queue one :class:`~rlwire.trainer.rollout.requests.Request`; a future of its
        :class:`~rlwire.trainer.rollout.requests.Completion` (token ids, behaviour log-probs
        and the weight version of each token)."""
        return self._requests().submit(request)

    def submit_all(self, requests: list[Request]) -> list[concurrent.futures.Future]:
        """:meth:`submit` for each of ``requests``, all admitted by the same step."""
        return self._requests().submit_all(requests)

    def _requests(self) -> EngineCore:
        if self.core is None:
            if not self.can_continue:
                raise NotImplementedError(
                    f"rollout engine {type(self).__name__}: takes no requests (no core of its "
                    "own, and not a PartialRolloutEngine)"
                )
            from .lockstep import lockstep_core

            self.core = lockstep_core(self)
        return self.core

    def between_steps(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` where no generation is in a step (in the core's thread, between two
        steps) and return what it returns; a weight commit returns its version, which the
        tokens sampled from then on carry."""
        if self.core is None:  # no request was ever served: nothing runs beside fn
            return fn()
        timeout = self.config.rollout.request_timeout
        try:
            return self.core.call(fn).result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"rollout engine {self.index}: no step boundary within {timeout:g} s to write "
                "the weights in (rollout.request_timeout)"
            ) from None

    def close(self) -> None:
        """Release what the engine holds beyond its process's memory (its core's thread; an
        override: its files, its server processes). The rollout worker calls it as the job
        ends, before the process is killed (``ray.kill``: no finalizer runs after it); a
        second call does nothing. An override calls ``super().close()``."""
        if self.core is not None:
            self.core.close(timeout=CLOSE_TIMEOUT)

    @abc.abstractmethod
    def digest(self) -> str | None:
        """A digest of the weights held now (``rlwire.trainer.rollout.weights_digest``), or
        None for an engine that cannot give one (``ckpt_engine.digest`` then says so once)."""

    def digest_parts(self) -> dict[str, str] | None:
        """The weights held now, tensor by tensor
        (``rlwire.trainer.rollout.digest.weights_digest_parts``), whose
        :func:`~.digest.digest_of_parts` is :meth:`digest`: what lets a run whose engine
        holds other weights than the actor sent name the first tensor that differs. None
        (the default): only :meth:`digest` is compared."""
        return None


class SleepingRolloutEngine(RolloutEngine):
    """A rollout engine that can free its device memory while the actor trains."""

    can_sleep: ClassVar[bool] = True

    @abc.abstractmethod
    def sleep(self) -> None:
        """Free device memory until :meth:`wake_up`."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Take the memory back; the weights are as before :meth:`sleep`."""


class StagingRolloutEngine(RolloutEngine):
    """A rollout engine that receives an update beside the weights it generates with, and
    writes it in later, between two generations."""

    stages_updates: ClassVar[bool] = True

    @abc.abstractmethod
    async def stage(self, engine) -> Callable[[], int]:
        """Receive one whole update from the checkpoint ``engine`` without changing the
        weights in use: it runs in a thread of its own while :meth:`generate` runs in
        another. Returns the commit: a call, made between two generations, that writes the
        update in and returns its version (one commit before the next ``stage``); it is
        run through :meth:`between_steps`."""

    async def apply(self, engine) -> int:
        return self.between_steps(await self.stage(engine))


class PartialRolloutEngine(RolloutEngine):
    """A rollout engine that generates in pieces: responses stopped after some tokens are
    continued later, possibly with newer weights (partial rollouts)."""

    can_continue: ClassVar[bool] = True

    @abc.abstractmethod
    def start(self, prompts: list[str]) -> Rollout:
        """``rollout.n`` rows per prompt (consecutive) with empty responses (``T = 0``)."""

    @abc.abstractmethod
    def extend(
        self, batch: Rollout, max_new_tokens: int, seed: int
    ) -> tuple[Rollout, torch.Tensor]:
        """Sample up to ``max_new_tokens`` more tokens for every row of ``batch`` (prompt,
        then a response with no end-of-sequence token yet; one sample per row), with the
        weights held now.

        Returns the rows with the new tokens appended to their responses (mask, behaviour
        log-probs and texts too; the earlier tokens' values unchanged) and a ``(B,)`` bool
        tensor: which rows ended with an end-of-sequence token."""


class RequestsEngine(PartialRolloutEngine):
    """A rollout engine that batches requests continuously (its own :attr:`core`, set in
    ``__init__``): ``generate`` and ``extend`` are layers over requests, every row
    submitted at once (so a call's batches, and its log-probs, do not depend on thread
    timing), row ``i`` of a call seeded ``request_seed(seed, i)``."""

    serves_requests = True
    tokenizer: Any
    """The model's tokenizer (``__init__`` sets it): prompts' token ids."""

    def generate(self, prompts: list[str], seed: int, sampling: Sampling | None = None) -> Rollout:
        cfg = self.config.rollout
        sampling = sampling or Sampling(
            n=cfg.n, temperature=cfg.temperature, greedy=False, **cfg.truncation()
        )
        encoded = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        rows = [list(ids) for ids in encoded for _ in range(sampling.n)]
        done = self._complete(rows, cfg.max_new_tokens, seed, sampling)
        return completions_rollout(self.tokenizer, rows, done)

    def _complete(
        self, rows: list[list[int]], max_new_tokens: int, seed: int, sampling: Sampling
    ) -> list:
        """The :class:`~rlwire.trainer.rollout.requests.Completion` of each row, all its
        requests admitted together."""
        requests = sample_requests(
            rows,
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            seed=seed,
            greedy=sampling.greedy,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
        timeout = self.config.rollout.request_timeout
        return wait_all(self.submit_all(requests), timeout, f"rollout engine {self.index}")

    def extend(
        self, batch: Rollout, max_new_tokens: int, seed: int
    ) -> tuple[Rollout, torch.Tensor]:
        rows = continuation_rows(batch)
        cfg = self.config.rollout
        sampling = Sampling(n=1, temperature=cfg.temperature, greedy=False, **cfg.truncation())
        done = self._complete([p + r for p, r, _ in rows], max_new_tokens, seed, sampling)
        grown = [
            (p, r + d.token_ids, lp + d.logprobs) for (p, r, lp), d in zip(rows, done, strict=True)
        ]
        ended = torch.tensor([d.finish_reason == "stop" for d in done], dtype=torch.bool)
        return token_rollout(self.tokenizer, grown), ended

    def start(self, prompts: list[str]) -> Rollout:
        n = self.config.rollout.n
        ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        return token_rollout(self.tokenizer, [(p, [], []) for p in ids for _ in range(n)])


def rollout_engine_class(backend: str) -> type[RolloutEngine]:
    """The engine class for ``rollout.backend``: a name from :data:`ROLLOUT_ENGINES` or a
    dotted path ``package.module:Class`` (see :func:`rlwire.trainer.plugins.load_class`)."""
    return load_class("rollout.backend", backend, ROLLOUT_ENGINES, RolloutEngine)
