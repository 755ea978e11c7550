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
    "save_steps": ("trainer.save_every", int),  # and save_hf_every: below
    "report_to": ("trainer.logger", _logger),
    "bf16": ("model.dtype", lambda v: "bfloat16" if v else "float32"),
    "gradient_checkpointing": ("model.enable_gradient_checkpointing", bool),
    "lr_scheduler_type": ("actor.optim.lr_scheduler_type", str),
    "warmup_ratio": ("actor.optim.lr_warmup_steps_ratio", float),
    "warmup_steps": ("actor.optim.lr_warmup_steps", int),
    "weight_decay": ("actor.optim.weight_decay", float),
    "max_grad_norm": ("actor.optim.grad_clip", float),
    "num_iterations": ("actor.ppo_epochs", int),
    "run_name": ("trainer.experiment_name", str),
    "save_total_limit": ("trainer.max_checkpoints_to_keep", lambda v: v),
    "eval_steps": ("validation.every", int),
    "vllm_server_base_url": ("rollout.server_urls", lambda v: None if v is None else [str(v)]),
}
"""TRL's ``GRPOConfig`` name -> (our key, conversion). ``max_steps`` (-1: unset), the batch
shape (``per_device_train_batch_size``, ``gradient_accumulation_steps``) and ``use_vllm``
with ``vllm_mode`` are combined below; ``logging_steps`` changes nothing (every step is
logged); ``hub_model_id`` is where :meth:`GRPOTrainer.push_to_hub` pushes."""

_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")
_VLLM = ("use_vllm", "vllm_mode")
_NO_EFFECT = ("logging_steps", "hub_model_id")
_VLLM_MODES = {"colocate": "vllm", "server": "vllm_server"}

TRL_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-6,
    "lr_scheduler_type": "linear",  # TrainingArguments': decay to 0 over the run
    "max_completion_length": 256,
    "num_generations": 8,
    "beta": 0.0,
    "num_train_epochs": 3,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "seed": 42,
}
"""TRL's own defaults (``GRPOConfig``, ``TrainingArguments``) for the names a user leaves
out, so that a TRL script means here what it means there; ``bf16`` is on where the GPU has
bfloat16 (TRL's default, off on a CPU). ``num_train_epochs`` applies when a dataset is given
and ``max_steps`` is not. ``rlwire-train`` keeps the tiny model's defaults."""


class GRPOConfig:
    """TRL's ``GRPOConfig`` names (:data:`TRL_KEYS`), plus ``overrides``: dotted keys of ours
    or verl's, applied last. A name not given takes TRL's default (:data:`TRL_DEFAULTS`);
    every other key ours (``rlwire-train --help-config``). The batch:
    ``per_device_train_batch_size`` completions
    per forward on each actor rank, times ``gradient_accumulation_steps`` times
    ``actor.world_size``, over ``num_generations``, prompts per step (TRL's generation
    batch, one optimizer step).

    Raises:
        ConfigError: TRL names without a row here, all of them in one line.
    """

    def __init__(self, *, overrides: Sequence[str] = (), **kwargs: Any) -> None:
        taken = {*TRL_KEYS, "max_steps", *_BATCH, *_VLLM, *_NO_EFFECT}
        unknown = sorted(set(kwargs) - taken)
        if unknown:
            raise ConfigError(
                f"GRPOConfig: {', '.join(unknown)} not taken here; the names taken: "
                f"{', '.join(sorted(taken))}; any key of rlwire-train's goes in "
                "overrides=['section.key=value', ...]"
            )
        mode = kwargs.get("vllm_mode", "colocate")
        if mode not in _VLLM_MODES:
            raise ConfigError(
                f"GRPOConfig.vllm_mode: {mode!r} is not allowed; use one of {list(_VLLM_MODES)}"
            )
        self.given = dict(kwargs)
        self.overrides = list(overrides)

    def with_defaults(self, has_dataset: bool) -> dict[str, Any]:
        """The names given, over TRL's defaults for the others (:data:`TRL_DEFAULTS`)."""
        defaults = dict(TRL_DEFAULTS)
        if not has_dataset or self.given.get("max_steps", -1) not in (None, -1):
            defaults.pop("num_train_epochs")  # steps: max_steps, or ours without rows
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            defaults["bf16"] = True
        return {**defaults, **self.given}

    def __repr__(self) -> str:
        return f"GRPOConfig({self.given!r}, overrides={self.overrides!r})"

    def settings(self, world_size: int, *, has_dataset: bool = True) -> dict[str, Any]:
        """Our dotted keys and values for ``actor.world_size`` ranks (``has_dataset``: a
        dataset is given, whose epochs set the steps when ``max_steps`` is not)."""
        out: dict[str, Any] = {}
        given = self.with_defaults(has_dataset)
        for name, value in given.items():
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
        steps = given.get("max_steps", -1)
        if steps is not None and steps > 0:  # TRL: max_steps wins over num_train_epochs
            out["trainer.steps"] = int(steps)
            out.pop("trainer.total_epochs", None)
        if "trainer.save_every" in out:  # TRL writes a model in every checkpoint-N/
            out["trainer.save_hf_every"] = out["trainer.save_every"]
        if given.get("use_vllm"):  # TRL: vllm_mode only with use_vllm
            out["rollout.backend"] = _VLLM_MODES[given.get("vllm_mode", "colocate")]
        elif "use_vllm" in given:
            out["rollout.backend"] = "hf"
        if any(name in given for name in _BATCH):
            per_device = int(given.get(_BATCH[0], 8))
            accumulation = int(given.get(_BATCH[1], 1))
            n = int(out.get("rollout.n", given.get("num_generations", 8)))
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
        # the batch shape's TRL names count completions over every rank
        world = load_config(overrides=[*items, *args.overrides]).actor.world_size
        has_dataset = self.train_rows is not None or any(
            o.startswith("data.source=") for o in args.overrides
        )
        chosen = args.settings(world, has_dataset=has_dataset)
        settings = [f"{key}={_text(value)}" for key, value in chosen.items()]
        self.config: TrainerConfig = load_config(overrides=[*items, *settings, *args.overrides])
        self.args = args
        self.result: RunResult | None = None

    def train(
        self, resume_from_checkpoint: bool | str | None = None, *, progress: bool = True
    ) -> RunResult:
        """Run the job; the run directory and a summary of the steps trained. As TRL's: a
        new run unless ``resume_from_checkpoint`` is true (the run directory's last
        checkpoint) or a checkpoint directory (``checkpoints/step_N``); the earlier run's
        checkpoints are moved aside, not deleted (``trainer.resume=never``)."""
        import dataclasses

        callables = any(not isinstance(f, str) for f in self.reward_funcs)
        inputs = Inputs(
            train_rows=self.train_rows,
            eval_rows=self.eval_rows,
            reward_functions=self.reward_funcs if callables else None,
        )
        if isinstance(resume_from_checkpoint, str):
            resume = resume_from_checkpoint
        else:
            resume = "auto" if resume_from_checkpoint else "never"
        if not any(o.startswith("trainer.resume=") for o in self.args.overrides):
            trainer = dataclasses.replace(self.config.trainer, resume=resume)
            self.config = dataclasses.replace(self.config, trainer=trainer)
        self.result = run(self.config, progress=progress, inputs=inputs)
        return self.result

    def _model_dir(self):
        if self.result is None:
            raise ConfigError("GRPOTrainer: train() first: there is no trained model yet")
        return self.result.run_dir / "hf_model"

    def save_model(self, output_dir: str | None = None) -> None:
        """Write the trained model (weights, config, tokenizer) to ``output_dir`` (None: the
        run directory, as TRL's ``args.output_dir``), loadable by ``transformers`` and vLLM.
        The run already holds it in ``hf_model/``: this copies that folder's files."""
        import shutil
        from pathlib import Path

        source = self._model_dir()
        target = Path(output_dir) if output_dir is not None else source.parent
        target.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.is_file():
                shutil.copy2(path, target / path.name)

    def push_to_hub(self, repo_id: str | None = None, *, private: bool | None = None) -> str:
        """Upload the trained model (``hf_model/``) to the Hub repository ``repo_id`` (None:
        ``hub_model_id``, else the experiment's name), with the login ``hf auth login`` left;
        returns the commit's URL. One line where the Hub cannot be reached."""
        import os

        folder = self._model_dir()
        repo = repo_id or self.args.given.get("hub_model_id") or self.config.trainer.experiment_name
        if not repo:
            raise ConfigError(
                "GRPOTrainer.push_to_hub: no repository: give repo_id, or hub_model_id or "
                "run_name in GRPOConfig"
            )
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
            raise ConfigError(
                f"GRPOTrainer.push_to_hub: HF_HUB_OFFLINE is set, so the Hub cannot be "
                f"reached; the model stays in {folder} (unset it, or upload that folder later)"
            )
        from huggingface_hub import HfApi

        api = HfApi()
        try:
            api.create_repo(repo, private=private, exist_ok=True)
            info = api.upload_folder(folder_path=str(folder), repo_id=repo)
        except Exception as err:  # network, auth: one line naming the repository
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"GRPOTrainer.push_to_hub: cannot upload {folder} to {repo!r}: {first}"
            ) from None
        return str(getattr(info, "commit_url", info))


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
