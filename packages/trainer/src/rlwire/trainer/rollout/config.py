"""The ``rollout`` section: which engine generates, how many workers, how many samples per
prompt and how long, and the ``vllm`` / ``vllm_server`` engines' own settings."""

from __future__ import annotations

import dataclasses

from ..checks import check, check_choice, check_engine
from .base import ROLLOUT_ENGINES, rollout_engine_class

__all__ = ["RolloutConfig", "VLLMSection"]


@dataclasses.dataclass(kw_only=True, slots=True)
class VLLMSection:
    kv_cache_memory_bytes: int | None = None
    """KV-cache size of each vLLM engine in bytes. None: on GPUs sized from
    ``gpu_memory_utilization``; on CPUs 64 MiB (enough for the tiny job; sizing from
    memory would claim most of the machine)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU's memory vLLM may use (weights and KV cache; vLLM checks at start
    that this much is free), split evenly between the rollout workers on one GPU."""
    max_model_len: int | None = None
    """Longest prompt + response (None: the model's own limit)."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation: fast start, slower decoding on GPUs."""
    tensor_parallel_size: int = 1
    """GPUs per vLLM engine (verl's ``rollout.tensor_model_parallel_size``). Only 1 in this
    version: each rollout worker is one Ray actor on one GPU (an engine over several GPUs
    needs a placement this trainer does not make yet); scale with ``rollout.num_workers``."""
    request_timeout: float = 600.0
    """``vllm_server``: seconds any HTTP call to a server may take; past it, as when the
    server refuses the connection, the server is lost (a line names it; its worker is
    replaced where the run heals, else the run stops)."""
    health_timeout: float = 60.0
    """``vllm_server``: seconds a server may leave ``/health`` unanswered (asked every 5 s)
    before it is lost: the requests in flight on it fail at once and its worker is
    replaced (a server given by URL is waited for, with backoff, and rejoins at the
    current weights once it answers)."""

    def __post_init__(self) -> None:
        check(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "rollout.vllm.kv_cache_memory_bytes",
            self.kv_cache_memory_bytes,
            "use an int > 0 or null",
        )
        check(
            0 < self.gpu_memory_utilization <= 1,
            "rollout.vllm.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "use a float in (0, 1]",
        )
        check(
            self.tensor_parallel_size == 1,
            "rollout.vllm.tensor_parallel_size",
            self.tensor_parallel_size,
            "use 1: an engine over several GPUs is not built yet (each rollout worker holds "
            "the whole model on one GPU); scale with rollout.num_workers",
        )
        check(
            self.request_timeout > 0,
            "rollout.vllm.request_timeout",
            self.request_timeout,
            "use seconds > 0",
        )
        check(
            self.health_timeout > 0,
            "rollout.vllm.health_timeout",
            self.health_timeout,
            "use seconds > 0",
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutConfig:
    backend: str = "hf"
    """Generation engine: ``hf`` (Hugging Face ``generate`` on a plain copy of the
    policy), ``vllm`` (a live ``vllm.LLM`` engine; extra ``rlwire-trainer[vllm]``),
    ``vllm_server`` (``vllm serve`` servers over HTTP: see ``rollout.server_urls``),
    ``paced`` (``hf`` at a set wall time per decoding step, ``rollout.paced_step_s``: a
    stand-in for an engine off the trainer's CPUs, for benchmarks and tests), or a
    dotted path ``package.module:Class`` to a ``rlwire.trainer.rollout.RolloutEngine``
    subclass (imported when the config loads, and in every rollout worker)."""
    num_workers: int = 1
    """Rollout workers (Ray actors), each with its own engine; all receive every weight
    update through the checkpoint engine."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    max_new_tokens: int = 8
    """Tokens generated per sample."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling (verl's ``rollout.top_p``): each token is drawn from the smallest
    set of most likely tokens whose probability reaches this, renormalised. 1.0: off. The
    behaviour log-probs are those of the cut distribution (vLLM's ``processed_logprobs``)
    while the actor's are the whole distribution's, so a cut shows in the off-policy
    correction's ``kl_rollout`` (colocated mode takes the update's own log-probs as the
    proximal ones and corrects nothing, as verl does)."""
    top_k: int = -1
    """The most likely tokens each draw keeps (verl's ``rollout.top_k``); -1 or 0: off. As
    ``top_p`` for the log-probs."""
    hybrid_engine: bool | None = None
    """Run each rollout engine inside an actor rank's process (verl's
    ``actor_rollout_ref.hybrid_engine``), one per rank: a weight sync is a hand-over in
    memory (the ``naive`` checkpoint engine), one call per rank, and there is no rollout
    process to start. None: on where it can be: colocated mode, a rollout backend that can
    share the actor's process (``hf``; ``vllm`` runs in its own), ``rollout.num_workers``
    equal to ``actor.world_size``, ``ckpt_engine.backend`` ``auto`` or ``naive`` and
    ``ckpt_engine.delta`` not ``on``; false: rollout workers of their own."""
    vllm: VLLMSection = dataclasses.field(default_factory=VLLMSection)
    server_urls: list[str] | None = None
    """``vllm_server``: running servers, one per rollout worker (``http://host:port``;
    started with the flags docs/trainer/vllm-server.md names). None: each rollout
    worker starts one on its node."""
    max_num_seqs: int = 256
    """Requests (samples, or model turns of conversations) an engine decodes together at
    most (vLLM's and verl's ``max_num_seqs``): ``hf``, ``paced`` and ``vllm`` batch them
    continuously, a request joining or leaving between two decoding steps; ``vllm_server``
    keeps that many completion calls in flight, which the server batches; more wait for
    room. Fully async: a rollout worker takes another chunk of groups while its samples in
    flight leave room for it."""
    kv_on_update: str = "keep"
    """What a weight update written in while requests are in flight (between two decoding
    steps; nothing is aborted) does to their KV cache: ``keep`` (continue on the cache the
    old weights computed, as vLLM's ``pause_generation(mode="keep")`` and PipelineRL do:
    no extra compute, the next tokens see keys and values of the old policy) or
    ``recompute`` (prefill every request in flight again with the new weights: one
    forward over its context). Either way each token records the version that sampled it.
    ``vllm_server`` always recomputes: a commit waits for the completion calls in flight,
    resets the server's prefix cache, and each request's next call is prefilled anew."""
    request_timeout: float = 600.0
    """Seconds one request (a sample, or a model turn) may take from submission to its
    last token before the rollout stops with a line naming it."""
    max_restarts: int = 3
    """A rollout worker that dies (its process, or the ``vllm serve`` server it started) is
    replaced while training goes on: its share of the batch is generated again by a worker
    that holds the same weights, with the same seed (fully async: the groups it held go
    back to be generated first), and the replacement joins the weight group at the next
    sync (:mod:`rlwire.trainer.runtime.healing`).
    At most this many replacements per worker within ``rollout.restart_window_s``; the
    next death stops the run with one line, as every death does with 0."""
    restart_window_s: float = 3600.0
    """The window ``rollout.max_restarts`` counts a worker's replacements in (seconds)."""
    paced_step_s: float = 0.004
    """``rollout.backend=paced`` only: wall seconds per decoding step of every generation
    call; the ``hf`` engine's generation, with the rest of that time waited out without
    using the CPU, as a GPU engine or a remote server looks to the trainer (benchmarks
    and tests of overlap)."""

    def truncation(self) -> dict[str, float | int]:
        """``top_p`` and ``top_k`` as a :class:`~rlwire.trainer.rollout.requests.Request`
        takes them (its ``top_k`` 0 is off)."""
        return {"top_p": self.top_p, "top_k": max(self.top_k, 0)}

    def __post_init__(self) -> None:
        check_engine(self.backend, "rollout.backend", ROLLOUT_ENGINES, rollout_engine_class)
        check(self.max_num_seqs >= 1, "rollout.max_num_seqs", self.max_num_seqs, "use an int >= 1")
        check_choice(self.kv_on_update, "rollout.kv_on_update", ("keep", "recompute"))
        check(self.request_timeout > 0, "rollout.request_timeout", self.request_timeout, "use > 0")
        check(self.max_restarts >= 0, "rollout.max_restarts", self.max_restarts, "use an int >= 0")
        check(
            self.restart_window_s > 0,
            "rollout.restart_window_s",
            self.restart_window_s,
            "use seconds > 0",
        )
        check(self.paced_step_s >= 0, "rollout.paced_step_s", self.paced_step_s, "use >= 0")
        check(self.num_workers >= 1, "rollout.num_workers", self.num_workers, "use an int >= 1")
        check(self.n >= 2, "rollout.n", self.n, "use an int >= 2 (GRPO compares a group)")
        check(
            self.max_new_tokens >= 1,
            "rollout.max_new_tokens",
            self.max_new_tokens,
            "use an int >= 1",
        )
        check(self.temperature > 0, "rollout.temperature", self.temperature, "use a float > 0")
        check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "use a float in (0, 1]")
        check(self.top_k >= -1, "rollout.top_k", self.top_k, "use an int >= 1, or -1 or 0 (off)")
        urls = self.server_urls
        if urls is not None:
            check(
                self.backend == "vllm_server",
                "rollout.server_urls",
                urls,
                "set it with rollout.backend=vllm_server only",
            )
            check(
                all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls),
                "rollout.server_urls",
                urls,
                "use http://host:port URLs",
            )
            check(
                len(urls) == self.num_workers,
                "rollout.server_urls",
                urls,
                f"give one per rollout worker (rollout.num_workers={self.num_workers})",
            )
