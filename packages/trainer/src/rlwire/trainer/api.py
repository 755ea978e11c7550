"""The Python API in TRL's shape: ``GRPOTrainer(model=..., reward_funcs=...,
train_dataset=..., args=GRPOConfig(...)).train()``.

It runs the job ``rlwire-train`` runs (:func:`rlwire.trainer.driver.run`, one code path): the
arguments become the same configuration (``trainer.config``, a
:class:`~rlwire.trainer.config.TrainerConfig`), the datasets its rows and the reward callables
its reward functions. :class:`GRPOConfig` takes TRL's ``GRPOConfig`` names, each one row of
:data:`TRL_KEYS` onto a key of ours (whose default applies when it is not given), and
``overrides`` for any key of ours or verl's; a TRL name with no row here is refused with the
others in one error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .config.root import ConfigError, TrainerConfig, load_config
from .driver import Inputs, RunResult, run

__all__ = ["TRL_KEYS", "GRPOConfig", "GRPOTrainer"]


def _logger(value: Any) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    return ["jsonl", *(n for n in names if n not in ("none", "jsonl"))]


_LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
_SCALE = {True: True, "group": True, False: False, "none": False}


def _choice(table: Mapping[Any, Any], name: str) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if value not in table:
            raise ConfigError(
                f"GRPOConfig.{name}: {value!r} is not allowed; use one of {list(table)}"
            )
        return table[value]

    return convert


TRL_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "output_dir": ("trainer.output_dir", str),
    "learning_rate": ("actor.optim.lr", float),
    "num_generations": ("rollout.n", int),
    "max_prompt_length": ("data.max_prompt_length", lambda v: v),
    "max_completion_length": ("rollout.max_new_tokens", int),
    "num_train_epochs": ("trainer.total_epochs", int),
    "temperature": ("rollout.temperature", float),
    "top_p": ("rollout.top_p", float),
    "top_k": ("rollout.top_k", lambda v: -1 if v is None else int(v)),
    "beta": ("algorithm.kl_coef", float),
    "epsilon": ("algorithm.clip_ratio", float),
    "epsilon_high": ("algorithm.clip_ratio_high", lambda v: v),
    "loss_type": ("algorithm.loss_agg", _choice(_LOSS_TYPES, "loss_type")),
    "scale_rewards": ("algorithm.norm_adv_by_std", _choice(_SCALE, "scale_rewards")),
    "reward_weights": ("reward.weights", lambda v: None if v is None else list(v)),
    "seed": ("trainer.seed", int),
    "save_steps": ("trainer.save_every", int),
    "report_to": ("trainer.logger", _logger),
    "bf16": ("model.dtype", lambda v: "bfloat16" if v else "float32"),
    "gradient_checkpointing": ("model.enable_gradient_checkpointing", bool),
    "lr_scheduler_type": ("actor.optim.lr_scheduler_type", str),
    "warmup_ratio": ("actor.optim.lr_warmup_steps_ratio", float),
    "warmup_steps": ("actor.optim.lr_warmup_steps", int),
    "weight_decay": ("actor.optim.weight_decay", float),
    "max_grad_norm": ("actor.optim.grad_clip", float),
    "num_iterations": ("actor.ppo_epochs", int),
    "use_vllm": ("rollout.backend", lambda v: "vllm" if v else "hf"),
}
"""TRL's ``GRPOConfig`` name -> (our key, conversion). ``max_steps`` (-1: unset) and the batch
shape (``per_device_train_batch_size``, ``gradient_accumulation_steps``) are combined below;
``logging_steps`` changes nothing (every step is logged)."""

_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")
_NO_EFFECT = ("logging_steps",)


class GRPOConfig:
    """TRL's ``GRPOConfig`` names (:data:`TRL_KEYS`), plus ``overrides``: dotted keys of ours
    or verl's, applied last. A name not given keeps our default (``rlwire-train
    --help-config``), not TRL's; the batch: ``per_device_train_batch_size`` completions
    per forward on each actor rank, times ``gradient_accumulation_steps`` times
    ``actor.world_size``, over ``num_generations``, prompts per step (TRL's generation
    batch, one optimizer step).

    Raises:
        ConfigError: TRL names without a row here, all of them in one line.
    """

    def __init__(self, *, overrides: Sequence[str] = (), **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(TRL_KEYS) - {"max_steps", *_BATCH, *_NO_EFFECT})
        if unknown:
            raise ConfigError(
                f"GRPOConfig: {', '.join(unknown)} not taken here; the names taken: "
                f"{', '.join(sorted([*TRL_KEYS, 'max_steps', *_BATCH]))}; any key of "
                "rlwire-train's goes in overrides=['section.key=value', ...]"
            )
        self.given = dict(kwargs)
        self.overrides = list(overrides)

    def __repr__(self) -> str:
        return f"GRPOConfig({self.given!r}, overrides={self.overrides!r})"

    def settings(self, world_size: int) -> dict[str, Any]:
        """Our dotted keys and values for ``actor.world_size`` ranks."""
        out: dict[str, Any] = {}
        for name, value in self.given.items():
            if name in TRL_KEYS:
                key, convert = TRL_KEYS[name]
                try:
                    out[key] = convert(value)
                except (TypeError, ValueError) as err:
                    if isinstance(err, ConfigError):
                        raise
                    raise ConfigError(
                        f"GRPOConfig.{name}: {value!r} is not allowed; it sets {key} "
                        "(rlwire-train --help-config)"
                    ) from None
        steps = self.given.get("max_steps", -1)
        if steps is not None and steps > 0:  # TRL: max_steps wins over num_train_epochs
            out["trainer.steps"] = int(steps)
            out.pop("trainer.total_epochs", None)
        if any(name in self.given for name in _BATCH):
            per_device = int(self.given.get(_BATCH[0], 8))
            accumulation = int(self.given.get(_BATCH[1], 1))
            n = int(out.get("rollout.n", self.given.get("num_generations", 8)))
            completions = per_device * accumulation * world_size
            if completions % n:
                raise ConfigError(
                    f"GRPOConfig: per_device_train_batch_size x gradient_accumulation_steps x "
                    f"actor.world_size ({per_device} x {accumulation} x {world_size} = "
                    f"{completions}) must be a multiple of num_generations ({n})"
                )
            out["data.train_batch_size"] = completions // n
            out["actor.micro_batch_size"] = per_device
        return out


def _rows(dataset: Any, name: str) -> list[Mapping[str, Any]] | None:
    """A ``datasets.Dataset`` or an iterable of dicts as a list of rows."""
    if dataset is None:
        return None
    if isinstance(dataset, (str, bytes, Mapping)) or not isinstance(dataset, Iterable):
        raise ConfigError(
            f"GRPOTrainer: {name} is a {type(dataset).__name__}; give a datasets.Dataset or a "
            "list of dicts (or name a file or Hub dataset with overrides=['data.source=...'])"
        )
    rows: list[Mapping[str, Any]] = [dict(row) for row in dataset]
    if not rows:
        raise ConfigError(f"GRPOTrainer: {name} holds no rows")
    return rows


def _lora(peft_config: Any) -> list[str]:
    """A PEFT ``LoraConfig`` as our ``actor.lora`` keys."""
    if peft_config is None:
        return []
    try:
        rank, alpha = peft_config.r, peft_config.lora_alpha
        targets = peft_config.target_modules
    except AttributeError:
        raise ConfigError(
            f"GRPOTrainer: peft_config is a {type(peft_config).__name__}; give a "
            "peft.LoraConfig (r, lora_alpha, target_modules)"
        ) from None
    targets = "all-linear" if targets is None else targets
    if not isinstance(targets, str):
        targets = "[" + ",".join(sorted(targets)) + "]"
    return [
        f"actor.lora.rank={rank}",
        f"actor.lora.alpha={alpha}",
        f"actor.lora.target_modules={targets}",
    ]


class GRPOTrainer:
    """TRL's ``GRPOTrainer`` shape over this trainer's job.

    Args:
        model: a local model directory, a Hub id, or ``"tiny"`` (the actor ranks load it in
            their own processes, so a model object is refused: save it and pass the path).
        reward_funcs: a reward or a list: callables with TRL's signature
            (``f(prompts, completions, completion_ids, **kwargs)``), verl's or the batch
            one, or names (``gsm8k``, ``math``, ``package.module:function``). Weights:
            ``args.reward_weights``.
        args: a :class:`GRPOConfig`, or None (our defaults).
        train_dataset: a ``datasets.Dataset`` or a list of dicts with a ``prompt`` column
            (text, or chat messages); every other column reaches TRL-signature rewards. None:
            ``data.source`` from ``args.overrides``.
        eval_dataset: held-out rows alike, validated as ``validation.*`` says
            (``overrides=['validation.every=5']``).
        peft_config: a ``peft.LoraConfig``: LoRA of that rank, alpha and target modules.

    Raises:
        ConfigError: a bad argument or setting, before anything starts.
    """

    def __init__(
        self,
        model: str,
        reward_funcs: Any,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
    ) -> None:
        if not isinstance(model, str):
            raise ConfigError(
                f"GRPOTrainer: model is a {type(model).__name__}; give its directory, a Hub id "
                "or 'tiny' (each actor rank loads it in its own process): "
                "model.save_pretrained(DIR), then model=DIR"
            )
        if processing_class is not None:
            raise ConfigError(
                "GRPOTrainer: processing_class is not taken; the model directory's own "
                "tokenizer is used (save yours beside the model with save_pretrained)"
            )
        args = args or GRPOConfig()
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ConfigError("GRPOTrainer: reward_funcs is empty; give at least one")
        for fn in funcs:
            if not (callable(fn) or isinstance(fn, str)):
                raise ConfigError(
                    f"GRPOTrainer: reward_funcs holds a {type(fn).__name__}; give callables "
                    "or names (gsm8k, math, package.module:function)"
                )
        self.train_rows = _rows(train_dataset, "train_dataset")
        self.eval_rows = _rows(eval_dataset, "eval_dataset")
        self.reward_funcs = funcs
        items = [f"model.path={model}", *_lora(peft_config)]
        if self.train_rows is not None:  # a label: the rows themselves are handed over
            items.append("data.source=train_dataset")
        if self.eval_rows is not None:
            items.append("validation.source=eval_dataset")
        names = [f if isinstance(f, str) else _name(f) for f in funcs]
        items.append(f"reward.function={_text(names)}")
        world = 1  # the batch shape's TRL names count completions over every rank
        if any(name in args.given for name in _BATCH):
            world = load_config(overrides=[*items, *args.overrides]).actor.world_size
        settings = [f"{key}={_text(value)}" for key, value in args.settings(world).items()]
        self.config: TrainerConfig = load_config(overrides=[*items, *settings, *args.overrides])

    def train(self, *, progress: bool = True) -> RunResult:
        """Run the job; the run directory and a summary of the steps trained."""
        callables = any(not isinstance(f, str) for f in self.reward_funcs)
        inputs = Inputs(
            train_rows=self.train_rows,
            eval_rows=self.eval_rows,
            reward_functions=self.reward_funcs if callables else None,
        )
        return run(self.config, progress=progress, inputs=inputs)


def _name(fn: Callable[..., Any]) -> str:
    """A callable's name for the config's record (``module:qualname``)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _text(value: Any) -> str:
    """A value as an override's text (YAML)."""
    import json

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)
