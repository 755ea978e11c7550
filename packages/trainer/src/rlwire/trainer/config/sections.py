"""The sections of the trainer's configuration: typed, documented dataclasses, each
validating its own values (``ConfigError`` names the key, the value and what is allowed).
:mod:`rlwire.trainer.config.root` assembles them and reads files and overrides. Sections owned
by one part of the trainer live beside it and are re-exported here: ``actor``
(:mod:`rlwire.trainer.actor.config`), ``data`` (:mod:`rlwire.trainer.data.dataset`), ``algorithm``
(:mod:`rlwire.trainer.algorithms.advantages`) and its ``rollout_correction``
(:mod:`rlwire.trainer.algorithms.correction`), ``rollout`` (:mod:`rlwire.trainer.rollout.config`),
``actor.lora`` (:mod:`rlwire.trainer.models.lora`)."""

from __future__ import annotations

import dataclasses
import math

from rlwire.ckpt_engine import (
    COMPRESS_MODES,
    DEFAULT_TIMEOUT_S,
    DELTA_MODES,
    parse_bucket_size,
)

from ..actor.config import ActorConfig, MegatronSection, OptimConfig
from ..algorithms.advantages import AlgorithmConfig
from ..checks import ConfigError, check, check_choice
from ..data.config import DataConfig, RewardConfig
from ..outputs.loggers import LOGGERS
from ..rollout.config import RolloutConfig, VLLMSection

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "CheckpointEngineConfig",
    "ConfigError",
    "DataConfig",
    "MegatronSection",
    "ModelConfig",
    "OptimConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerSection",
    "VLLMSection",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = "tiny"
    """A local Hugging Face model directory, a Hub id (``Qwen/Qwen2.5-0.5B-Instruct``:
    downloaded through ``huggingface_hub`` on first use, from its cache after that and
    with ``HF_HUB_OFFLINE=1``), or ``tiny``: a small Qwen2-architecture model with random
    weights and a matching tokenizer, built locally (no download) and cached under the
    output directory."""
    dtype: str = "float32"
    """The dtype the model computes in and the rollout engines hold: ``float32`` or
    ``bfloat16`` (what real models train in on GPUs; a run of another model than ``tiny``
    in float32 on a GPU is warned about). ``bfloat16`` means what TRL's ``bf16=True`` and
    verl's FSDP actor mean: the actor keeps float32 master weights and optimizer state and
    computes in bf16 (mixed precision), each sync casting to bf16 for the engines;
    ``actor.master_dtype=bfloat16`` for pure bf16 parameters."""
    enable_gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them (verl's key; Hugging Face's ``gradient_checkpointing_enable``, non-reentrant):
    activation memory of one layer instead of all, for about one more forward pass of
    compute. The gradients are the same."""

    def __post_init__(self) -> None:
        check_choice(self.dtype, "model.dtype", ("float32", "bfloat16"))


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckpointEngineConfig:
    backend: str = "auto"
    """A ``rlwire.ckpt_engine`` backend name, or ``auto``: on CPUs ``shm`` when every member
    is on one host and ``/dev/shm`` can hold the weights twice over (then actor rank 0 keeps
    the full weights in its shared arena: zero-copy), else ``gloo``; on GPUs ``cuda_ipc``
    when every rollout worker shares actor rank 0's GPU, ``nccl`` when every member has a
    GPU of its own, else ``gloo``."""
    bucket_size: str | None = None
    """Bytes per bucket (``rlwire.ckpt_engine.parse_bucket_size`` syntax: ``512MiB``,
    ``2GB``, bytes, or ``auto``); None takes the library's default
    (``rlwire.ckpt_engine.DEFAULT_BUCKET_SIZE``). Checked when the config is loaded."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any weight-sync wait may block before the run stops with an error (the
    library's default, ``rlwire.ckpt_engine.DEFAULT_TIMEOUT_S``)."""
    delta: str = "auto"
    """Lossless delta updates (``rlwire.ckpt_engine``'s ``delta``): ``on`` sends only the
    elements that changed since the last sync when every rollout worker holds it (``hf``,
    ``vllm`` and ``vllm_server`` do);
    ``auto`` does so until a delta is not below half the dense bytes (fp32 weights under
    AdamW change almost everywhere: then dense from there on); ``off``. Costs actor rank 0
    one copy of the full weights. Bucketed backends only (``gloo``, ``shm``, ``nccl``,
    ``cuda_ipc``); with another backend, or a rollout backend that takes whole weights
    only, ``auto`` means ``off`` and ``on`` is refused."""
    delta_sharded: bool = False
    """Each actor rank diffs its own shard against its copy of what the last sync sent,
    before anything is gathered (verl's ``delta_sharded``): a sync gathers only the changed
    elements to rank 0 (not the whole model) and the comparison is split over the ranks;
    rank 0's engine keeps no mirror (its copy of the whole weights, kept up to date with
    the changes, stands for it). Costs each rank one copy of its shards. Needs
    ``delta=on`` and an actor that knows its shards (``fsdp2`` without LoRA, or one rank);
    another falls back to comparing whole tensors on rank 0. Off by default while it is new."""
    in_place: bool = False
    """Weights used in place on one host: actor rank 0 keeps two ``shm`` arenas with the
    weights' layout and writes each sync into the one no rollout worker reads; each ``hf``
    rollout engine takes that arena's tensors as its parameters at its commit (a pointer
    swap, no copy of its own) and says it left the older arena, which the next sync then
    reuses. Memory: two copies of the weights in ``/dev/shm`` per host instead of one per
    rollout engine (worth it from two engines on a host; the wrong choice with one, or
    where ``/dev/shm`` is small). Needs ``backend`` ``shm`` (or ``auto`` resolving to it),
    ``rollout.backend=hf`` without LoRA, and sends dense updates (``delta`` is off: a
    delta would apply onto the older version the other arena holds)."""
    compress: str = "off"
    """``zstd`` compresses each delta tensor's payload where that makes it smaller
    (``rlwire.ckpt_engine``'s ``compress``; the ``zstandard`` package on every member):
    for a ``gloo`` link between hosts slower than compressing (about 0.3-0.5 GB/s per
    core), not for one host (loopback, ``shm``), where it costs more than it saves.
    ``off`` (default). Needs ``delta`` not ``off``."""
    per_rank: bool | None = None
    """Who sends the weights to rollout workers in processes of their own: ``true``: every
    actor rank, to the rollout workers on its own GPU (on CPUs rollout worker ``j`` is rank
    ``j % actor.world_size``'s), all ranks at once, each rank the master of a group of its
    own (every rank gathers the full tensors anyway); ``false``: actor rank 0 to every
    worker; ``null`` (default): per rank on GPUs when every rollout worker shares a GPU with
    an actor rank (then ``backend=auto`` is ``cuda_ipc``: nothing through the host), rank 0
    otherwise. Costs each sending rank what rank 0 alone pays otherwise (a delta mirror, a
    fully-async snapshot). Rank 0 only with ``delta_sharded`` or ``in_place``. The run's log
    says once which rank sends to which workers over which backend, and why."""
    digest: bool = False
    """After every sync, digest the weights on the sending and on each receiving side
    (:class:`~rlwire.trainer.rollout.WeightsDigest`: integer fingerprints of the fp32 values
    reduced on the tensors' own device, one read-back per side; ``hf`` backend), record
    both in the metrics and compare them: an engine holding other weights than the actor
    sent stops the run at that sync, naming the version, the rollout worker and the first
    tensor that differs (an engine that gives no digest, vLLM's, is said once). Costs one
    pass over the weights per side (about a device copy's time); for checking that updates
    really arrive."""

    def __post_init__(self) -> None:
        try:
            parse_bucket_size(self.bucket_size)
        except ValueError as err:  # "bucket_size: ... is not allowed; use ..."
            raise ConfigError(f"ckpt_engine.{err}") from None
        check(self.timeout > 0, "ckpt_engine.timeout", self.timeout, "use seconds > 0")
        check_choice(self.delta, "ckpt_engine.delta", DELTA_MODES)
        check_choice(self.compress, "ckpt_engine.compress", COMPRESS_MODES)
        check(
            not self.in_place or self.delta != "on",
            "ckpt_engine.delta",
            self.delta,
            "ckpt_engine.in_place sends dense updates: use auto or off",
        )
        check(
            not self.delta_sharded or self.delta == "on",
            "ckpt_engine.delta",
            self.delta,
            "ckpt_engine.delta_sharded needs ckpt_engine.delta=on",
        )
        check(
            not (self.per_rank and (self.delta_sharded or self.in_place)),
            "ckpt_engine.per_rank",
            self.per_rank,
            "delta_sharded and in_place are designs around actor rank 0's one copy of the "
            "whole weights: set per_rank to false or null",
        )
        check(
            self.compress == "off" or self.delta != "off",
            "ckpt_engine.compress",
            self.compress,
            "compress compresses delta updates: set ckpt_engine.delta to on or auto too",
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class AsyncConfig:
    staleness_threshold: float = 1.0
    """verl's bound on stale samples (``trainer.mode=fully_async``): rollout workers pause
    once ``R x T x (1 + staleness_threshold)`` prompt groups were started since the last
    weight sync (counting those still queued at it), where ``R`` is
    ``data.train_batch_size`` and ``T`` is ``trigger_parameter_sync_step``. 0 makes every
    update wait for fresh samples."""
    trigger_parameter_sync_step: int = 1
    """Push weights to the rollout workers after every this many updates."""
    max_version_lag: int | None = None
    """The most versions a group's oldest token may lag the weights being updated (see
    ``max_off_policy_strategy``). None: ``T x (1 + ceil(S)) - 1``, the most the bound above
    allows, so nothing is dropped in a steady run."""
    max_off_policy_strategy: str = "drop"
    """What happens to a group past ``max_version_lag`` (verl's fully-async
    ``max_off_policy_strategy``): ``drop`` (dropped, counted as ``dropped_samples``, and
    its prompt generated again with newer weights; a worker whose weights already lag by
    more is handed no group until it syncs, so it starts none that could only be
    dropped) or ``keep`` (trained anyway, the off-policy correction weighing it)."""
    sample_timeout: float = 600.0
    """Seconds the trainer may wait for one step's samples before the run stops."""
    chunk_groups: int | None = None
    """Prompt groups a rollout worker is handed at once (each group is a task of its own,
    its samples requests to the engine, and goes to the queue when it completes). None:
    ``data.train_batch_size`` over the workers, rounded up. A worker takes another chunk
    while its samples in flight leave room under ``rollout.max_num_seqs``; the staleness
    bound still caps the groups in flight."""
    partial_rollout: bool | None = None
    """Partial rollouts (verl's key; None: on, verl's default, where the rollout engine
    takes requests, as every built-in one does): a weight sync is written in at once,
    between two decoding steps, and the requests in flight carry on with the new weights
    (nothing is aborted; the KV cache as ``rollout.kv_on_update`` says); every token keeps
    the version and behaviour log-prob it was sampled with, and a sample's lag is its
    oldest token's. Off: a worker writes the update in once its groups in flight completed
    (each sample one version, at the cost of a drain at every sync)."""
    partial_rollout_chunk_tokens: int = 8
    """With ``partial_rollout``, on an engine whose requests go in calls of several tokens
    (``vllm_server``: each request a chain of completion calls; a third party's engine with
    only ``extend``: one call per step of a lock-step core): tokens per call, so that an
    update waits at most this many tokens. ``hf``, ``paced`` and ``vllm`` write updates in
    between any two decoding steps."""

    def __post_init__(self) -> None:
        check(
            self.staleness_threshold >= 0,
            "async.staleness_threshold",
            self.staleness_threshold,
            "use a float >= 0",
        )
        check(
            self.trigger_parameter_sync_step >= 1,
            "async.trigger_parameter_sync_step",
            self.trigger_parameter_sync_step,
            "use an int >= 1",
        )
        check(
            self.max_version_lag is None or self.max_version_lag >= 0,
            "async.max_version_lag",
            self.max_version_lag,
            "use an int >= 0 or null",
        )
        check(
            self.chunk_groups is None or self.chunk_groups >= 1,
            "async.chunk_groups",
            self.chunk_groups,
            "use an int >= 1 or null",
        )
        check(self.sample_timeout > 0, "async.sample_timeout", self.sample_timeout, "use > 0")
        check_choice(
            self.max_off_policy_strategy, "async.max_off_policy_strategy", ("drop", "keep")
        )
        check(
            self.partial_rollout_chunk_tokens >= 1,
            "async.partial_rollout_chunk_tokens",
            self.partial_rollout_chunk_tokens,
            "use an int >= 1",
        )

    def version_lag_bound(self) -> int:
        """The largest version lag a consumed group may have."""
        if self.max_version_lag is not None:
            return self.max_version_lag
        t = self.trigger_parameter_sync_step
        return t * (1 + math.ceil(self.staleness_threshold)) - 1


MANIFEST_POLICIES = ("require", "warn")
"""``trainer.checkpoint_manifest``'s values."""
MODES = ("colocated", "one_step_off", "fully_async")
"""``trainer.mode``'s values."""
_MODE_ALIASES = {"one_step_off_policy": "one_step_off", "fully_async_policy": "fully_async"}
"""verl's recipe names for the modes."""


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerSection:
    mode: str = "colocated"
    """``colocated`` (generate, then update, then sync: every sample is on-policy),
    ``one_step_off`` (verl's ``one_step_off_policy`` recipe, also accepted: the next batch
    is generated with the previous weights while the update runs; every sample after the
    first batch is exactly one version stale, the sync happens between steps, and the run
    is deterministic for a seed) or ``fully_async`` (rollout workers generate continuously
    into a bounded queue while the actor trains; see the ``async`` section; verl's
    ``fully_async_policy`` is accepted)."""
    steps: int = 100
    """Training steps to run (each one batch of ``data.train_batch_size`` prompts)."""
    total_epochs: int | None = None
    """Passes over a data file (verl's key): sets ``trainer.steps`` to this times the whole
    batches of ``data.train_batch_size`` its rows make (as verl's loader, which drops a
    partial last one; the batches walk the rows epoch after epoch, each epoch in the
    order ``data.shuffle`` gives).
    ``trainer.steps`` (verl's ``total_training_steps``) given as well wins; a built-in task
    has no epochs."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    output_dir: str | None = None
    """Run directory: config, metrics.jsonl, plot, log, checkpoints (verl's
    ``default_local_dir``). None: ``runs/<project_name>/<experiment_name>`` when the
    experiment is named (as verl's ``checkpoints/{project}/{experiment}``), else
    ``runs/default``: a named experiment never resumes another's checkpoints."""
    rollout_data_dir: str | None = None
    """Write every step's trained samples here as JSONL (verl's key), ``<step>.jsonl``: one
    line a sample (a trajectory), with the prompt and the conversation as text, the token
    ids, the loss mask, the model tokens' behaviour log-probs and versions, the turns and
    tool calls, the reward and the advantage. None: not written."""
    save_every: int = 25
    """Checkpoint every this many steps (0: only at the end)."""
    save_hf_every: int = 0
    """Write ``hf_models/step_<N>``, the weights as a Hugging Face folder ``transformers``
    and vLLM load (LoRA merged), every this many steps (TRL's model in every
    ``checkpoint-N``); 0: only ``hf_model/`` at the end. Any checkpoint can be exported
    afterwards too: ``rlwire-train export RUN_DIR --step N``."""
    max_checkpoints_to_keep: int | None = None
    """Complete checkpoints kept in ``checkpoints/`` (verl's ``max_actor_ckpt_to_keep``):
    older ones, and unfinished ones older than the newest complete one, are removed only
    after a newer checkpoint is complete. Null: keep all."""
    resume: str = "auto"
    """``auto`` (latest checkpoint in output_dir, if any), ``never``, or a checkpoint path.
    A checkpoint written for another model, data source or advantage estimator is refused,
    naming what differs (see ``resume_anyway``)."""
    resume_anyway: bool = False
    """Resume from a checkpoint written for another model, data source or advantage
    estimator (a model moved to another folder, a data file renamed): only the actor
    strategy and the LoRA rank must still match."""
    checkpoint_manifest: str = "require"
    """What a resume does with a checkpoint that has no ``MANIFEST.json`` (each file's size
    and SHA-256; written by rlwire since manifests exist): ``require`` refuses it, since a
    damaged file in it (a flipped byte in a tensor) would load silently; ``warn`` says so in
    one line and resumes from it unchecked. A checkpoint with a manifest is always checked."""
    logger: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    """Where each step's metrics go (verl's key): any of ``console`` (a line per step),
    ``jsonl`` (``metrics.jsonl``, always written), ``tensorboard`` (extra
    ``rlwire-trainer[tensorboard]``) and ``wandb`` (extra ``rlwire-trainer[wandb]``; online
    with the user's ``wandb login`` or ``WANDB_API_KEY``, else offline, said in one line)."""
    project_name: str = "rlwire"
    """The wandb project, and the run directory's parent when ``experiment_name`` is set."""
    experiment_name: str | None = None
    """The wandb run name and the run directory's name (``output_dir``). None: the run
    directory's name is the wandb run's."""
    balance_batch: bool = False
    """verl's key: give every actor rank the same number of samples with near-equal real
    tokens (prompt + response; :func:`rlwire.trainer.algorithms.micro_batches.rank_shares`) rather
    than
    consecutive rows, so that no rank waits for one holding the long responses. Off by
    default here (verl's default is on): it reorders the samples over the ranks, which
    changes a multi-rank run's floating-point sums."""

    @property
    def run_directory(self) -> str:
        """``output_dir``, or the one the names give when it is unset."""
        if self.output_dir is not None:
            return self.output_dir
        if self.experiment_name is not None:
            return f"runs/{self.project_name}/{self.experiment_name}"
        return "runs/default"

    @property
    def off_policy(self) -> bool:
        """Whether samples may come from older weights than those being updated (every
        mode but ``colocated``): the off-policy correction's ``auto`` turns on, and the
        proximal log-probs need their own forward pass."""
        return self.mode != "colocated"

    def __post_init__(self) -> None:
        self.mode = _MODE_ALIASES.get(self.mode, self.mode)
        check_choice(self.mode, "trainer.mode", MODES)
        for key in ("project_name", "experiment_name"):
            name = getattr(self, key)
            check(
                name is None or (name not in ("", ".", "..") and "/" not in name),
                f"trainer.{key}",
                name,
                "use a name without '/' (it names a folder of the run directory's path)",
            )
        if isinstance(self.logger, str):  # one name, or verl's list
            self.logger = [self.logger]
        check(
            isinstance(self.logger, list), "trainer.logger", self.logger, f"use a list of {LOGGERS}"
        )
        for name in self.logger:
            check_choice(name, "trainer.logger", LOGGERS)
        check(self.steps >= 1, "trainer.steps", self.steps, "use an int >= 1")
        check(
            self.total_epochs is None or self.total_epochs >= 1,
            "trainer.total_epochs",
            self.total_epochs,
            "use an int >= 1, or null",
        )
        check_choice(self.checkpoint_manifest, "trainer.checkpoint_manifest", MANIFEST_POLICIES)
        check(self.save_every >= 0, "trainer.save_every", self.save_every, "use an int >= 0")
        check(
            self.save_hf_every >= 0, "trainer.save_hf_every", self.save_hf_every, "use an int >= 0"
        )
        keep = self.max_checkpoints_to_keep
        check(
            keep is None or keep >= 1,
            "trainer.max_checkpoints_to_keep",
            keep,
            "use an int >= 1, or null (keep all)",
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class RayConfig:
    address: str | None = None
    """An existing cluster (``ray://...`` or ``host:port``); None: ``RAY_ADDRESS``, else one of
    the run's own (even beside one ``ray start`` runs)."""
    num_cpus: int | None = None
    """CPUs of the embedded local cluster (None: all, and at least one per worker)."""
    num_gpus: int | None = None
    """GPUs of the embedded local cluster (None: Ray detects them)."""
    worker_threads: int | None = None
    """torch threads in every actor rank and rollout worker; None: automatic, once the
    model is loaded: one for a model under 1M parameters (its ops are too small to split:
    the default job ran at 2326 samples/s with one, 1901 with two), otherwise the node's
    cores shared among the processes that compute at the same time (the actor ranks in
    hybrid colocated mode; the larger of actor ranks and rollout workers when their phases
    alternate; all of them in fully-async mode): a 24M-parameter model on this 2-core
    machine went from 46 to 73 samples/s with two."""
    driver_threads: int = 1
    """torch threads in the driver's process while the job runs (restored after). Its
    tensor work is bookkeeping (advantages, batches, metrics); with more threads each
    small op leaves them spinning on cores the workers need (default job on this 2-core
    machine: 1807-2237 samples/s with torch's default of two, 2488-2808 with one). A reward
    function heavy in torch may want more."""
    startup_timeout: float = 120.0
    """Seconds for the workers to be scheduled and start before the run stops."""
    task_timeout: float = 3600.0
    """Seconds any one call to the workers may take (a generation, an update, a save)
    before the run stops with an error naming it. Weight syncs are bounded by
    ``ckpt_engine.timeout`` per wait instead (a large model may take longer in all)."""

    def __post_init__(self) -> None:
        for key in ("startup_timeout", "task_timeout"):
            value = getattr(self, key)
            check(value > 0, f"ray.{key}", value, "use seconds > 0")
        check(
            self.driver_threads >= 1, "ray.driver_threads", self.driver_threads, "use an int >= 1"
        )
        check(
            self.worker_threads is None or self.worker_threads >= 1,
            "ray.worker_threads",
            self.worker_threads,
            "use an int >= 1, or null (automatic)",
        )
