"""The ``actor`` section: the actor engine's configuration (strategy, batch splitting, the
optimizer, Megatron's own settings, LoRA), beside the engines that read it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rlwire.grad_sync import GradSyncConfig

from ..checks import check, check_choice, check_engine
from ..models.lora import LoraSection
from .base import ACTOR_ENGINES, actor_engine_class

__all__ = ["ActorConfig", "MegatronSection", "OptimConfig"]


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    """AdamW learning rate: suits the built-in tiny model only; real models want about 1e-6
    (verl's examples; the ``qwen2.5-0.5b`` preset), and a run of another model at this
    default is warned about."""
    lr_warmup_steps: int = -1
    """Steps over which the learning rate rises linearly from 0 (verl's key; the first step
    takes 0). -1 (or 0): ``lr_warmup_steps_ratio`` of ``trainer.steps``."""
    lr_warmup_steps_ratio: float = 0.0
    """The warm-up as a fraction of ``trainer.steps`` (verl's key), when
    ``lr_warmup_steps`` is not set."""
    lr_scheduler_type: str = "constant"
    """After the warm-up: ``constant``, ``cosine`` (down to ``min_lr_ratio`` x lr by
    ``trainer.steps``, over ``num_cycles`` cosine cycles; verl's) or ``linear`` (down to 0
    by ``trainer.steps``: transformers' default, TRL's). verl's key (its older
    ``warmup_style`` is accepted)."""
    min_lr_ratio: float = 0.0
    """The cosine schedule's floor, as a fraction of ``lr`` (verl's key)."""
    num_cycles: float = 0.5
    """Cosine cycles over the steps after the warm-up (0.5: one half-cosine down)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    stale_lr_kl: float | None = 0.1
    """Staleness-aware step size (off-policy modes): an update whose samples are older than
    the weights it changes takes ``lr / (1 + mean version lag)`` when the updates since the
    samples were drawn moved the policy by more than this many nats per response
    (``kl_behaviour_proximal`` x ``response_length``, over the whole batch): there one-step
    stale gradients at the full step overshoot, and token-level importance weights do not
    see a shift of the whole response (measured: docs/results/modes-lock-step.md). 0: on every stale
    batch; null: never. ``lr_scale`` in the metrics shows each step's factor on ``lr``
    (this one times the schedule's); colocated updates (lag 0) are never scaled."""

    def __post_init__(self) -> None:
        check(self.lr > 0, "actor.optim.lr", self.lr, "use a float > 0")
        check(self.grad_clip >= 0, "actor.optim.grad_clip", self.grad_clip, "use a float >= 0")
        check_choice(
            self.lr_scheduler_type,
            "actor.optim.lr_scheduler_type",
            ("constant", "cosine", "linear"),
        )
        check(
            0 <= self.lr_warmup_steps_ratio < 1,
            "actor.optim.lr_warmup_steps_ratio",
            self.lr_warmup_steps_ratio,
            "use a float in [0, 1)",
        )
        check(
            0 <= self.min_lr_ratio <= 1,
            "actor.optim.min_lr_ratio",
            self.min_lr_ratio,
            "use a float in [0, 1]",
        )
        check(
            self.stale_lr_kl is None or self.stale_lr_kl >= 0,
            "actor.optim.stale_lr_kl",
            self.stale_lr_kl,
            "use a float >= 0, or null (never)",
        )

    def warmup_steps(self, total: int) -> int:
        """Warm-up steps of a run of ``total`` steps."""
        if self.lr_warmup_steps > 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * total)

    def schedule(self, step: int, total: int) -> float:
        """The factor on ``lr`` at update ``step`` (0-based) of ``total``: verl's
        ``get_constant_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup``,
        transformers' ``get_linear_schedule_with_warmup`` (a pure function of the step, so
        a resumed run goes on where it stopped)."""
        warmup = self.warmup_steps(total)
        if step < warmup:
            return step / max(1, warmup)
        if self.lr_scheduler_type == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if self.lr_scheduler_type == "linear":  # transformers' get_linear_schedule_with_warmup
            return max(0.0, 1.0 - progress)
        wave = math.cos(math.pi * self.num_cycles * 2.0 * progress)
        low = self.min_lr_ratio
        return max(low, wave * (1 - low) * 0.5 + (1 + low) * 0.5)

    def lr_scale(self, lag: float, kl: float) -> float:
        """The factor on ``lr`` for an update whose samples lag ``lag`` versions on average,
        the policy having moved ``kl`` nats per response since they were drawn."""
        if lag <= 0 or self.stale_lr_kl is None or kl <= self.stale_lr_kl:
            return 1.0
        return 1.0 / (1.0 + lag)


@dataclasses.dataclass(kw_only=True, slots=True)
class MegatronSection:
    use_distributed_optimizer: bool = True
    """Megatron's distributed optimizer: optimizer state and fp32 main parameters sharded
    over the data-parallel ranks (works on gloo/CPU too)."""
    optimizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Megatron ``OptimizerConfig`` fields beyond ``actor.optim`` (which gives ``lr``,
    ``weight_decay`` and ``clip_grad``), e.g. ``use_precision_aware_optimizer``,
    ``main_grads_dtype``; dtypes as strings (``bf16``, ``fp32``)."""
    override_optimizer_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``OptimizerConfig`` fields applied last (verl's ``override_optimizer_config``)."""
    override_ddp_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``DistributedDataParallelConfig`` fields; they win over the gradient dtype
    ``rlwire.megatron_ddp`` derives from the optimizer (e.g. ``grad_reduce_in_fp32``,
    ``bucket_size``, ``overlap_grad_reduce``)."""
    tensor_model_parallel_size: int = 1
    """Only 1: this engine is data parallel (TP needs Megatron's own model code)."""
    pipeline_model_parallel_size: int = 1
    """Only 1: this engine is data parallel (PP needs Megatron's own model code)."""

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            check(
                getattr(self, key) == 1,
                f"actor.megatron.{key}",
                getattr(self, key),
                "the Megatron engine is data parallel only (tensor and pipeline parallelism "
                "are out of scope); use 1 and scale with actor.world_size",
            )


@dataclasses.dataclass(kw_only=True, slots=True)
class ActorConfig:
    strategy: str = "fsdp2"
    """The actor engine: ``fsdp2`` (``fully_shard``), ``fsdp`` (FSDP1), ``megatron``
    (Megatron-Core DDP and optimizer, through ``rlwire-megatron-ddp``), or a dotted path
    ``package.module:Class`` to a ``rlwire.trainer.actor.ActorEngine`` subclass (imported
    when the config loads, and in every actor process)."""
    world_size: int = 1
    """Actor ranks (Ray actors forming a gloo/NCCL group)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward on one rank (verl's ``ppo_micro_batch_size_per_gpu``).
    None: a whole mini-batch share in one pass (fastest where it fits in memory: on the
    default job 1445 samples/s against 985 with 8; set it for models whose activations do
    not fit)."""
    use_dynamic_bsz: bool = False
    """Token-budget micro-batches (verl's key): each mini-batch's rows on a rank are grouped
    into micro-batches of at most ``ppo_max_token_len_per_gpu`` real tokens (prompt +
    response; a longer row alone), balanced by token count, each padded only to its own
    longest prompt and response; ``micro_batch_size`` is then unused. Every rank runs the
    most micro-batches any rank needs (one all-reduce per mini-batch). Less padding is
    computed when lengths vary; the rows of a micro-batch are mixed long and short to balance
    the counts, so without ``use_remove_padding`` much padding remains and the gain is small
    (measured: docs/results/algorithms.md). False: ``micro_batch_size`` rows each, padded to the
    mini-batch's longest prompt and response."""
    ppo_max_token_len_per_gpu: int = 16384
    """Real tokens per micro-batch on one rank with ``use_dynamic_bsz`` (verl's key and
    default): the memory knob, as ``micro_batch_size`` is for fixed rows (activations grow
    with it; packed under ``sdpa`` or ``eager`` attention, the attention mask with its
    square)."""
    log_prob_micro_batch_size: int | None = None
    """Sequences per forward-only pass (the proximal and reference log-probs) on one rank:
    verl's ``rollout.`` and ``ref.log_prob_micro_batch_size_per_gpu`` (one value here).
    None: as the update's (``micro_batch_size``)."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Token-budget micro-batches for the forward-only passes (the proximal and reference
    log-probs; verl's ``rollout.`` and ``ref.log_prob_use_dynamic_bsz``). None: as
    ``use_dynamic_bsz``."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Their budget (verl's ``rollout.`` and ``ref.log_prob_max_token_len_per_gpu``): a
    forward without backward keeps no activations, so a larger one fits. None:
    ``ppo_max_token_len_per_gpu``."""
    use_remove_padding: bool = False
    """Padding-free forward (verl's ``model.use_remove_padding``): each micro-batch's
    sequences packed into one row with restarting ``position_ids`` and no attention mask,
    for the update and the forward-only passes. Needs a Hugging Face attention
    implementation that keeps packed sequences apart: ``sdpa``, ``eager``,
    ``flex_attention`` (a block-diagonal causal mask, quadratic in the packed length) or
    ``flash_attention_2``/``3``/``4`` (varlen); another is refused at the first forward.
    Pairs with ``use_dynamic_bsz``, whose budget bounds the packed length."""
    ppo_mini_batch_size: int | None = None
    """Prompts per optimizer step (verl's meaning: each with its ``rollout.n`` samples,
    split over the actor ranks); a batch of ``data.train_batch_size`` prompts takes
    ``train_batch_size / ppo_mini_batch_size`` steps per epoch. None: the whole batch,
    one step."""
    ppo_epochs: int = 1
    """Passes over each batch's mini-batches."""
    mixed_precision: bool = False
    """bf16 compute with fp32 gradient reduction (FSDP's ``MixedPrecisionPolicy``) over
    float32 parameters, the rollout engines staying in ``model.dtype``. On already with
    ``model.dtype=bfloat16`` (and float32 ``master_dtype``)."""
    master_dtype: str = "float32"
    """The dtype the FSDP actor holds its parameters (the master weights), their
    gradients and AdamW's state in, and checkpoints and exports are written in:
    ``float32`` (TRL's and verl's: with ``model.dtype=bfloat16`` the model computes in
    bf16 over float32 master weights) or ``bfloat16`` (pure bf16, with
    ``model.dtype=bfloat16`` only: half the memory of the weights and optimizer state, but
    an update smaller than half a bf16 step of a weight is lost, so most weights stop
    changing below lr of about 1e-5; warned at start-up with the share it loses). Megatron
    keeps float32 main weights in its optimizer for bf16 parameters itself."""
    offload: bool = False
    """Move parameters and optimizer state to host between phases (``rlwire.offload``)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    grad_sync: GradSyncConfig = dataclasses.field(default_factory=GradSyncConfig)
    """``rlwire.grad_sync``'s own config (``policy``: ``defer``, ``every`` or ``auto``;
    ``memory_budget_bytes`` for ``auto``). verl's
    ``actor.fsdp.use_no_sync_for_gradient_accumulation`` (True → defer, False → every) is
    accepted as an alias."""
    megatron: MegatronSection = dataclasses.field(default_factory=MegatronSection)
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)

    def __post_init__(self) -> None:
        check_engine(self.strategy, "actor.strategy", ACTOR_ENGINES, actor_engine_class)
        check_choice(self.master_dtype, "actor.master_dtype", ("float32", "bfloat16"))
        check(
            not (self.master_dtype == "bfloat16" and self.strategy == "megatron"),
            "actor.master_dtype",
            self.master_dtype,
            "Megatron's optimizer keeps float32 main weights of bf16 parameters; leave it at "
            "float32 with actor.strategy=megatron",
        )
        check(
            not (self.lora.enabled and self.strategy == "megatron"),
            "actor.lora.rank",
            self.lora.rank,
            "the megatron strategy trains every weight; use actor.strategy=fsdp2 or fsdp for "
            "LoRA, or rank 0",
        )
        check(self.world_size >= 1, "actor.world_size", self.world_size, "use an int >= 1")
        check(self.ppo_epochs >= 1, "actor.ppo_epochs", self.ppo_epochs, "use an int >= 1")
        for key in (
            "micro_batch_size",
            "ppo_mini_batch_size",
            "log_prob_max_token_len_per_gpu",
            "log_prob_micro_batch_size",
        ):
            value = getattr(self, key)
            check(value is None or value >= 1, f"actor.{key}", value, "use an int >= 1 or null")
        check(
            self.ppo_max_token_len_per_gpu >= 1,
            "actor.ppo_max_token_len_per_gpu",
            self.ppo_max_token_len_per_gpu,
            "use an int >= 1",
        )

    def update_token_budget(self) -> int | None:
        """Real tokens per update micro-batch (None: fixed rows, ``micro_batch_size``)."""
        return self.ppo_max_token_len_per_gpu if self.use_dynamic_bsz else None

    def log_prob_token_budget(self) -> int | None:
        """Real tokens per micro-batch of the forward-only passes (None: fixed rows)."""
        dynamic = self.log_prob_use_dynamic_bsz
        if not (self.use_dynamic_bsz if dynamic is None else dynamic):
            return None
        return self.log_prob_max_token_len_per_gpu or self.ppo_max_token_len_per_gpu
