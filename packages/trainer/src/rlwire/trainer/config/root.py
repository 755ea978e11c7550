"""The trainer's configuration: the sections (:mod:`rlwire.trainer.config.sections`) in one tree,
the presets, and ``load_config`` (YAML files and dotted overrides, read by
:mod:`rlwire.trainer.config.overrides`).

Every default lives in its section's dataclass, once. ``load_config(path, overrides)`` starts from
the defaults, merges a YAML file, then ``dotted.key=value`` overrides, and
validates: an unknown key fails with the valid keys at that level and the
closest match; a wrong type or out-of-range value fails naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlwire.ckpt_engine import registry as engine_registry

from ..agent.config import AgentConfig, check_agent
from ..checks import check
from ..data.config import ValidationConfig
from ..data.tasks import builtin_task
from ..rollout.base import rollout_engine_class
from .overrides import (
    flatten,
    joined,
    merge,
    nest,
    parse_item,
    parse_scalar,
    resolve_interpolations,
    to_dict,
)
from .sections import (
    ActorConfig,
    AlgorithmConfig,
    AsyncConfig,
    CheckpointEngineConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    RayConfig,
    RewardConfig,
    RolloutConfig,
    TrainerSection,
)
from .verl_keys import translate

log = logging.getLogger("rlwire.trainer")

SMALL_MODEL_PARAMETERS = 1_000_000
"""Below this a worker computes on one thread (``ray.worker_threads`` automatic)."""

PRESETS: dict[str, tuple[str, ...]] = {
    "realistic": (
        "data.source=builtin:count",
        "rollout.max_new_tokens=32",
        "actor.optim.lr=5e-4",
        "trainer.steps=400",
        "trainer.output_dir=runs/realistic",
    ),
    "qwen2.5-0.5b": (
        "model.path=Qwen/Qwen2.5-0.5B-Instruct",
        "model.dtype=bfloat16",
        "model.enable_gradient_checkpointing=true",
        "actor.optim.lr=1e-6",
        "actor.optim.lr_warmup_steps=10",
        "actor.use_remove_padding=true",
        "actor.ppo_mini_batch_size=32",
        "actor.micro_batch_size=16",
        "algorithm.kl_coef=0.001",
        "data.train_batch_size=64",
        "data.max_prompt_length=512",
        "data.filter_overlong_prompts=true",
        "rollout.backend=vllm",
        "rollout.n=5",
        "rollout.max_new_tokens=512",
        "rollout.vllm.gpu_memory_utilization=0.5",
        "trainer.save_every=50",
        "trainer.output_dir=runs/qwen2.5-0.5b",
    ),
}
"""Named jobs (``rlwire-train --preset NAME``): overrides applied over the defaults, before
a config file and the command line's own. ``realistic``: the ``count`` task (response
lengths with a long tail) at a learning rate where one update moves the policy about as
far per token as a real LLM run's (docs/results/modes.md, "The realistic preset").
``qwen2.5-0.5b``: a real small model on one GPU (Qwen2.5-0.5B-Instruct from the Hub, in
bfloat16, verl's GSM8K GRPO settings: lr 1e-6 after 10 warm-up steps, 64 prompts x 5
samples a step in mini-batches of 32, responses up to 512 tokens, vLLM rollout); give it
``data.source`` (examples/gsm8k prepares verl's GSM8K files) and ``trainer.steps`` or
``trainer.total_epochs``. Not yet run on a GPU."""

REAL_MODEL_DEFAULTS: dict[str, Any] = {
    "rollout.max_new_tokens": 256,
    "actor.optim.lr": 1e-6,
    "actor.optim.lr_scheduler_type": "linear",
    "rollout.n": 8,
}
"""What a run of any model other than the built-in tiny one (:func:`is_tiny`) takes for the
keys it leaves out (the sections' own defaults suit the tiny model: 8 new tokens, lr 3e-3):
TRL's ``GRPOConfig`` defaults (``max_completion_length``, ``learning_rate``, ``lr_scheduler_type``,
``num_generations``; the same values as :data:`rlwire.trainer.api.TRL_DEFAULTS`),
said once at start-up. A built-in task's own settings give way to them; the run's keys win."""

# The sections themselves are public in rlwire.trainer.config.sections.
__all__ = [
    "PRESETS",
    "REAL_MODEL_DEFAULTS",
    "is_tiny",
    "ConfigError",
    "TrainerConfig",
    "load_config",
    "to_dict",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    ckpt_engine: CheckpointEngineConfig = dataclasses.field(default_factory=CheckpointEngineConfig)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
    async_: AsyncConfig = dataclasses.field(default_factory=AsyncConfig)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    """Fully-async mode (the key is ``async``; verl's ``async_training`` is accepted)."""
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        prompts, actor = self.data.train_batch_size, self.actor
        mini = actor.ppo_mini_batch_size or prompts
        per_step = actor.world_size * (actor.micro_batch_size or 1)
        split = "actor.world_size" + (" x actor.micro_batch_size" if actor.micro_batch_size else "")
        if mini == prompts:
            check(
                prompts * self.rollout.n % per_step == 0,
                "data.train_batch_size",
                prompts,
                f"train_batch_size x rollout.n ({prompts * self.rollout.n}) must be a multiple "
                f"of {split} ({per_step})",
            )
        else:
            check(
                prompts % mini == 0 and mini * self.rollout.n % per_step == 0,
                "actor.ppo_mini_batch_size",
                mini,
                f"it must divide data.train_batch_size ({prompts}), and ppo_mini_batch_size x "
                f"rollout.n must be a multiple of {split} ({per_step})",
            )
        if self.async_.partial_rollout and self.trainer.mode == "fully_async":
            check(
                self._takes_requests(),
                "async.partial_rollout",
                True,
                f"rollout.backend {self.rollout.backend!r} takes no requests (neither "
                "serves_requests nor a rlwire.trainer.rollout.PartialRolloutEngine); set it "
                "to false",
            )

        check(
            not (self.actor.master_dtype == "bfloat16" and self.model.dtype == "float32"),
            "actor.master_dtype",
            "bfloat16",
            "the master weights cannot be narrower than the model's compute "
            "(model.dtype=float32); set model.dtype=bfloat16 for pure bf16",
        )
        if self.agent.enable:
            check_agent(self)
        overlong = self.reward.overlong_buffer
        if overlong.enable:
            check(
                overlong.len <= self.rollout.max_new_tokens,
                "reward.overlong_buffer.len",
                overlong.len,
                f"use at most rollout.max_new_tokens ({self.rollout.max_new_tokens})",
            )
        if self.actor.lora.enabled:
            check(
                rollout_engine_class(self.rollout.backend).takes_lora,
                "actor.lora.rank",
                self.actor.lora.rank,
                f"rollout.backend {self.rollout.backend!r} does not take LoRA adapters; use "
                "rollout.backend=hf, or rank 0",
            )
        if self.rollout.hybrid_engine:
            obstacles = self._hybrid_obstacles()
            check(
                not obstacles,
                "rollout.hybrid_engine",
                True,
                f"it cannot be on with {'; '.join(obstacles)}; set it to false or null",
            )
        if self.ckpt_engine.in_place:
            check(
                self.rollout.backend == "hf" and not self.actor.lora.enabled,
                "ckpt_engine.in_place",
                True,
                f"the weights used in place are the hf rollout engine's whole parameters; "
                f"rollout.backend is {self.rollout.backend!r}"
                + (" with LoRA" if self.actor.lora.enabled else "")
                + ": set it to false",
            )
            check(
                self.ckpt_engine.backend in ("auto", "shm"),
                "ckpt_engine.in_place",
                True,
                f"it needs ckpt_engine.backend shm (one host), not {self.ckpt_engine.backend!r}",
            )
        if self.ckpt_engine.delta == "on":
            check(
                rollout_engine_class(self.rollout.backend).takes_deltas,
                "ckpt_engine.delta",
                "on",
                f"rollout.backend {self.rollout.backend!r} takes whole weights only; use "
                "'auto' or 'off'",
            )
            backend = self.ckpt_engine.backend
            try:
                sends_deltas = backend == "auto" or engine_registry.capabilities(backend).delta
            except (ValueError, ImportError) as err:  # unknown, or its dependency is missing
                raise ConfigError(f"ckpt_engine.backend: {err}") from None
            check(
                sends_deltas,
                "ckpt_engine.delta",
                "on",
                f"ckpt_engine.backend {backend!r} sends whole weights only; use 'auto' or 'off'",
            )

    def held_dtype(self) -> str:
        """The dtype the actor holds its parameters in, and writes checkpoints and exports
        in: ``actor.master_dtype`` for FSDP, ``model.dtype`` for Megatron (whose optimizer
        keeps float32 main weights of bf16 parameters itself)."""
        if self.actor.strategy == "megatron":
            return self.model.dtype
        return self.actor.master_dtype  # bfloat16 only with model.dtype=bfloat16: checked

    def mixed_precision(self) -> bool:
        """Whether the FSDP actor computes in bf16 over float32 parameters: with
        ``model.dtype=bfloat16`` over float32 master weights, or ``actor.mixed_precision``."""
        return self.actor.mixed_precision or (self.held_dtype() != self.model.dtype)

    def _takes_requests(self) -> bool:
        engine = rollout_engine_class(self.rollout.backend)
        return engine.serves_requests or engine.can_continue

    def partial_rollouts(self) -> bool:
        """Whether fully-async workers write a sync in with requests in flight
        (``async.partial_rollout``, resolved: None is on where the rollout engine takes
        requests, verl's default). Resolved here, not stored: the sections are built before
        the overrides that set the mode are merged."""
        if self.async_.partial_rollout is not None:
            return self.async_.partial_rollout
        return self.trainer.mode == "fully_async" and self._takes_requests()

    def hybrid_engine(self) -> bool:
        """Whether each rollout engine runs inside an actor rank's process
        (``rollout.hybrid_engine``, resolved; see its description)."""
        if self.rollout.hybrid_engine is not None:
            return self.rollout.hybrid_engine
        return not self._hybrid_obstacles()

    def _hybrid_obstacles(self) -> list[str]:
        """What keeps the rollout engines out of the actor ranks' processes."""
        rollout, engine = self.rollout, rollout_engine_class(self.rollout.backend)
        obstacles = {
            f"trainer.mode={self.trainer.mode!r} (colocated only)": self.trainer.mode
            != "colocated",
            f"rollout.backend={rollout.backend!r} runs in its own process": not engine.hybrid,
            f"rollout.num_workers={rollout.num_workers} (one engine per actor rank: "
            f"actor.world_size={self.actor.world_size})": rollout.num_workers
            != self.actor.world_size,
            f"ckpt_engine.backend={self.ckpt_engine.backend!r} (in process: 'auto' or "
            "'naive')": self.ckpt_engine.backend not in ("auto", "naive"),
            "ckpt_engine.delta='on' (the in-process hand-over sends whole tensors)": (
                self.ckpt_engine.delta == "on"
            ),
            "ckpt_engine.in_place (engines in their own processes, on shm)": (
                self.ckpt_engine.in_place
            ),
        }
        return [what for what, blocks in obstacles.items() if blocks]

    def worker_threads(self, parameters: int, cores: int) -> int:
        """torch threads for a worker process on a node of ``cores`` cores whose model has
        ``parameters`` parameters (``ray.worker_threads``; see its description)."""
        if self.ray.worker_threads is not None:
            return self.ray.worker_threads
        if parameters < SMALL_MODEL_PARAMETERS:
            return 1
        world, workers = self.actor.world_size, self.rollout.num_workers
        if self.hybrid_engine():
            at_once = world
        elif self.trainer.mode == "colocated":
            at_once = max(world, workers)
        else:
            at_once = world + workers
        return max(1, cores // at_once)

    def reuses_training_logprobs(self) -> bool:
        """Whether the update is exactly on-policy, so that the proximal log-probs are the
        training forward's own (detached) and no separate forward pass is run for them:
        colocated (the rollout holds the actor's weights), one mini-batch, one epoch, and
        no off-policy correction that needs them before the loss (``rollout_is``,
        ``rollout_rs``, ``bypass_mode``)."""
        correction = self.algorithm.rollout_correction
        return (
            self.trainer.mode == "colocated"
            and self.actor.ppo_mini_batch_size in (None, self.data.train_batch_size)
            and self.actor.ppo_epochs == 1
            and correction.is_level(off_policy=False) is None
            and correction.rollout_rs is None
            and not correction.bypass_mode
        )

    def fills_batches(self) -> bool:
        """Whether a generated batch is scored, some of its groups dropped and the batch filled
        up with more (:func:`~rlwire.trainer.algorithms.scoring.fill`): dynamic sampling
        (``algorithm.filter_groups``), or ``agent.failure=drop``."""
        agent = self.agent
        drops = agent.function is not None and agent.failure == "drop"
        return self.algorithm.filter_groups.enable or drops

    def mini_batch_rows(self) -> int:
        """Samples per optimizer step on one actor rank."""
        mini = self.actor.ppo_mini_batch_size or self.data.train_batch_size
        return mini * self.rollout.n // self.actor.world_size

    def micro_batch_rows(self) -> int:
        """Samples per forward/backward on one actor rank (``actor.micro_batch_size``, or
        the whole mini-batch share)."""
        return self.actor.micro_batch_size or self.mini_batch_rows()


def is_tiny(path: str) -> bool:
    """Whether ``model.path`` is the built-in tiny model: ``tiny``, or a folder one of its
    builders wrote (:data:`rlwire.trainer.models.tiny.TINY_MARK` in its ``config.json``)."""
    from ..models.tiny import TINY_MARK

    if path == "tiny":
        return True
    try:
        fields = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):  # a Hub id, or not a model folder (the run says so later)
        return False
    return isinstance(fields, dict) and fields.get(TINY_MARK) is True


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, preset: str | None = None
) -> TrainerConfig:
    """Defaults, then the preset's overrides (:data:`PRESETS`), then the YAML file at
    ``path``, then ``key.sub=value`` overrides.

    Raises:
        ConfigError: unknown keys (with the valid ones and the closest match),
            wrong types or values (naming the key), a malformed override, an unknown
            preset, or a missing/unreadable file.
    """
    import yaml

    flat: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"--preset: {preset!r} is unknown; use one of {sorted(PRESETS)}")
        flat.update(parse_item(i) for i in PRESETS[preset])
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as err:
            raise ConfigError(f"--config: cannot read {path}: {err.strerror}") from err
        except yaml.YAMLError as err:
            raise ConfigError(f"--config: {path} is not valid YAML: {err}") from err
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"--config: {path} must hold a mapping of sections")
        flat.update(flatten(loaded))
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if key.startswith("~"):
            raise ConfigError(
                f"override {item!r}: Hydra's ~key removes a key from verl's defaults; here "
                "every key has a default: leave it out, or set it"
            )
        key = key.removeprefix("++").removeprefix("+")  # Hydra's add (+) and add-or-set (++)
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        flat[key] = parse_scalar(text)
    flat = resolve_interpolations(flat)
    ours, problems, notes = translate(flat)
    for note in notes:
        log.warning("%s", note)
    if "trainer.steps" in ours:  # verl: total_training_steps wins over total_epochs
        ours.pop("trainer.total_epochs", None)
    task = builtin_task(ours.get("data.source", DataConfig().source))
    defaults: dict[str, Any] = {}
    if task is not None:  # the task's own settings, under everything the run sets
        defaults = dict(parse_item(i) for i in task.defaults)
        if ours.get("agent.function") is not None:  # the agent calls the task's tools itself
            defaults.pop("agent.tools", None)
    if not is_tiny(ours.get("model.path", ModelConfig().path)):
        real = {key: value for key, value in REAL_MODEL_DEFAULTS.items() if key not in ours}
        if real:
            log.warning(
                "model.path=%s is not the tiny model: %s (TRL's defaults) for the keys left out",
                ours["model.path"],
                " ".join(f"{key}={value}" for key, value in real.items()),
            )
        defaults.update(real)
    ours = {**defaults, **ours}
    try:
        nested = nest(ours)
    except ConfigError as err:
        problems.append(str(err))
        nested = {}
    config = merge(TrainerConfig, TrainerConfig(), nested, "", problems)
    if problems:  # the keys' own problems and the sections': one pass, a line each
        raise ConfigError(joined(problems))
    return config
