"""verl's configuration keys: the ones naming a feature ``rlwire-train`` has, mapped to its own
keys (overrides and ``--config`` files alike); the ones naming a feature it lacks, refused
together in one message.

A verl key for a missing feature is accepted only when it leaves the feature off (false,
null, 0 or empty), since nothing is then asked for; any other value stops the run. A verl key
whose job is done another way here (``use_shm``, ``layered_summon``, ``load_format``, ...)
is accepted with one line saying it changes nothing. Every problem is reported in one pass.
:func:`alias_table` is the docs' table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..checks import ConfigError

__all__ = ["ALIASES", "NO_EFFECT", "alias_table", "translate"]


def _same(key: str, value: Any) -> Any:
    return value


def _same_none(key: str, value: Any) -> Any:
    return None  # accepted, nothing to set


def _choices(mapping: Mapping[Any, Any]) -> Callable[[str, Any], Any]:
    def convert(key: str, value: Any) -> Any:
        if value not in mapping:
            raise ConfigError(f"{key}: {value!r} is not allowed; use one of {list(mapping)}")
        return mapping[value]

    return convert


def _files(key: str, value: Any) -> Any:
    if isinstance(value, (list, tuple)):  # one file as itself; several read as one data set
        return value[0] if len(value) == 1 else list(value)
    return value


def _mebibytes(key: str, value: Any) -> Any:
    return f"{value}MiB"  # verl's megabytes are 2**20 bytes


def _instead(what: str) -> Callable[[str, Any], Any]:
    """A verl key whose feature rlwire-train has under another form: null only, else one
    line saying what to use instead."""

    def convert(key: str, value: Any) -> Any:
        if value is not None:
            raise ConfigError(f"{key}: {value!r} is not allowed here; {what}")
        return None

    return convert


def _freq(key: str, value: Any) -> Any:
    return 0 if value == -1 else value  # verl's -1: never periodically (ours: 0)


@dataclasses.dataclass(frozen=True, slots=True)
class Alias:
    verl: str
    ours: str
    convert: Callable[[str, Any], Any] = _same
    note: str = ""


_ACTOR, _ROLLOUT = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
_NO_SYNC = _choices({True: "defer", False: "every"})
_ONE = "rollout's and ref's: one value (set both alike)"

ALIASES: tuple[Alias, ...] = (
    Alias("data.train_files", "data.source", _files, "several files: one data set"),
    Alias("data.max_response_length", "rollout.max_new_tokens"),
    Alias("data.filter_overlong_prompts_workers", "", _same_none, "tokenized in the driver"),
    Alias("reward_model.enable", "", _same_none, "reward_model.model.path sets the model"),
    Alias("reward_model.model.path", "reward.model"),
    Alias("reward_model.micro_batch_size_per_gpu", "reward.model_batch_size"),
    Alias("actor_rollout_ref.model.path", "model.path"),
    Alias("actor_rollout_ref.model.lora_rank", "actor.lora.rank"),
    Alias("actor_rollout_ref.model.lora_alpha", "actor.lora.alpha"),
    Alias("actor_rollout_ref.model.target_modules", "actor.lora.target_modules"),
    Alias(_ACTOR + "strategy", "actor.strategy"),
    Alias(_ACTOR + "optim.lr", "actor.optim.lr"),
    Alias(_ACTOR + "optim.weight_decay", "actor.optim.weight_decay"),
    *(
        Alias(_ACTOR + f"optim.{key}", f"actor.optim.{key}")
        for key in (
            "lr_warmup_steps",
            "lr_warmup_steps_ratio",
            "lr_scheduler_type",
            "min_lr_ratio",
            "num_cycles",
        )
    ),
    Alias(_ACTOR + "optim.warmup_style", "actor.optim.lr_scheduler_type", note="verl's older name"),
    Alias(_ACTOR + "grad_clip", "actor.optim.grad_clip"),
    Alias(_ACTOR + "clip_ratio", "algorithm.clip_ratio"),
    Alias(_ACTOR + "ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    Alias(_ACTOR + "ppo_epochs", "actor.ppo_epochs"),
    Alias(_ACTOR + "ppo_micro_batch_size_per_gpu", "actor.micro_batch_size"),
    Alias(_ACTOR + "use_dynamic_bsz", "actor.use_dynamic_bsz"),
    Alias(_ACTOR + "ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu"),
    *(  # the forward-only passes (verl sets the proximal's under rollout): one value here
        Alias(f"actor_rollout_ref.{part}.log_prob_{key}", f"actor.log_prob_{key}", _same, _ONE)
        for part in ("rollout", "ref")
        for key in ("use_dynamic_bsz", "max_token_len_per_gpu")
    ),
    *(
        Alias(
            f"actor_rollout_ref.{part}.log_prob_micro_batch_size_per_gpu",
            "actor.log_prob_micro_batch_size",
            _same,
            _ONE,
        )
        for part in ("rollout", "ref")
    ),
    Alias("actor_rollout_ref.model.use_remove_padding", "actor.use_remove_padding"),
    Alias(
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "model.enable_gradient_checkpointing",
    ),
    Alias(_ACTOR + "clip_ratio_low", "algorithm.clip_ratio_low"),
    Alias(_ACTOR + "clip_ratio_high", "algorithm.clip_ratio_high"),
    Alias(_ACTOR + "clip_ratio_c", "algorithm.clip_ratio_c"),
    Alias(_ACTOR + "policy_loss.loss_mode", "algorithm.loss_mode"),
    Alias(_ACTOR + "entropy_coeff", "algorithm.entropy_coeff"),
    Alias(_ACTOR + "loss_agg_mode", "algorithm.loss_agg"),
    *(  # verl's key, and the short spelling rlwire-train accepted before
        Alias(key, "actor.grad_sync.policy", _NO_SYNC, "true: defer, false: every")
        for key in (
            _ACTOR + "fsdp_config.use_no_sync_for_gradient_accumulation",
            "actor.fsdp.use_no_sync_for_gradient_accumulation",
        )
    ),
    Alias("actor_rollout_ref.hybrid_engine", "rollout.hybrid_engine"),
    Alias(_ROLLOUT + "name", "rollout.backend", _choices({"hf": "hf", "vllm": "vllm"})),
    Alias(_ROLLOUT + "n", "rollout.n"),
    Alias(_ROLLOUT + "temperature", "rollout.temperature"),
    Alias(_ROLLOUT + "max_num_seqs", "rollout.max_num_seqs"),
    Alias(_ROLLOUT + "gpu_memory_utilization", "rollout.vllm.gpu_memory_utilization"),
    Alias(_ROLLOUT + "enforce_eager", "rollout.vllm.enforce_eager"),
    Alias(_ROLLOUT + "max_model_len", "rollout.vllm.max_model_len"),
    Alias(_ROLLOUT + "tensor_model_parallel_size", "rollout.vllm.tensor_parallel_size"),
    Alias(_ROLLOUT + "top_p", "rollout.top_p"),
    Alias(_ROLLOUT + "top_k", "rollout.top_k"),
    Alias(
        _ROLLOUT + "checkpoint_engine.backend",
        "ckpt_engine.backend",
        lambda key, value: str(value).removeprefix("rlwire_"),
        "rlwire_<name> -> <name>",
    ),
    Alias(
        _ROLLOUT + "checkpoint_engine.update_weights_bucket_megabytes",
        "ckpt_engine.bucket_size",
        _mebibytes,
        "N -> 'NMiB'",
    ),
    *(
        Alias(_ROLLOUT + f"multi_turn.{key}", f"agent.{key}")
        for key in (
            "enable",
            "max_assistant_turns",
            "max_user_turns",
            "max_parallel_calls",
            "max_tool_response_length",
            "format",
        )
    ),
    Alias(
        _ROLLOUT + "multi_turn.tool_response_truncate_side",
        "",
        _choices({"middle": None}),
        "'middle' only",
    ),
    Alias(
        _ROLLOUT + "multi_turn.tool_config_path",
        "",
        _instead(
            "verl's tool classes (verl.tools.base_tool.BaseTool) run only inside verl; name "
            "plain Python functions in agent.tools (package.module:function) instead"
        ),
        "null only: agent.tools",
    ),
    Alias(
        _ROLLOUT + "multi_turn.interaction_config_path",
        "",
        _instead(
            "verl's interactions run only inside verl; name an rlwire.trainer.agent.Environment "
            "subclass in agent.environment (package.module:Class) instead"
        ),
        "null only: agent.environment",
    ),
    Alias("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    *(  # verl 0.9's dapo reward manager's keys, and the DAPO recipe's older spelling
        Alias(f"{prefix}.{key}", f"reward.overlong_buffer.{key}")
        for prefix in ("reward.reward_kwargs.overlong_buffer_cfg", "reward_model.overlong_buffer")
        for key in ("enable", "len", "penalty_factor")
    ),
    *(
        Alias(f"{prefix}.log", "", _same_none, "always logged")
        for prefix in ("reward.reward_kwargs.overlong_buffer_cfg", "reward_model.overlong_buffer")
    ),
    Alias("algorithm.adv_estimator", "algorithm.adv_estimator"),
    Alias("algorithm.gamma", "", _choices({1: None}), "only 1 (outcome rewards)"),
    Alias("data.val_files", "validation.source", _files, "several files: one data set"),
    Alias("trainer.test_freq", "validation.every", _freq, "-1 -> 0"),
    Alias("trainer.val_before_train", "validation.before_train"),
    *(
        Alias(_ROLLOUT + f"val_kwargs.{key}", f"validation.{key}")
        for key in ("n", "temperature", "do_sample")
    ),
    Alias(_ROLLOUT + "val_kwargs.top_k", "", _choices({-1: None, 0: None}), "-1 or 0 only"),
    Alias(_ROLLOUT + "val_kwargs.top_p", "", _choices({1: None}), "1.0 only"),
    Alias("trainer.total_training_steps", "trainer.steps"),
    Alias("trainer.save_freq", "trainer.save_every", _freq, "-1 -> 0"),
    Alias("trainer.max_actor_ckpt_to_keep", "trainer.max_checkpoints_to_keep"),
    Alias("trainer.default_local_dir", "trainer.output_dir"),
    Alias(
        "trainer.resume_mode",
        "trainer.resume",
        _choices({"auto": "auto", "disable": "never", "resume_path": None}),
        "disable: never; resume_path: trainer.resume_from_path",
    ),
    Alias("trainer.resume_from_path", "trainer.resume"),
)
"""One verl key each; ``ours`` empty: checked, nothing to set."""

# verl keys that combine into one of ours: (keys, our key, how, note)
_COMBINED = (
    (
        (_ACTOR + "use_kl_loss", _ACTOR + "kl_loss_coef", _ACTOR + "kl_loss_type"),
        "algorithm.kl_coef",
        "use_kl_loss true: kl_loss_coef (kl_loss_type low_var_kl, the k3 estimator); false: 0",
    ),
    (
        (_ACTOR + "fsdp_config.param_offload", _ACTOR + "fsdp_config.optimizer_offload"),
        "actor.offload",
        "both true or both false",
    ),
    (
        ("custom_reward_function.path", "custom_reward_function.name"),
        "reward.function",
        "path:name (name defaults to compute_score)",
    ),
    (
        ("trainer.n_gpus_per_node", "trainer.nnodes"),
        "actor.world_size",
        "their product (1 each when unset); rollout.num_workers follows unless set: one "
        "engine per rollout.vllm.tensor_parallel_size GPUs",
    ),
)

NO_EFFECT: dict[str, str] = {
    "actor_rollout_ref.model.use_shm": "model.path is read as it is",
    _ROLLOUT + "layered_summon": "the weights reach the rollout in buckets (ckpt_engine)",
    _ROLLOUT + "load_format": "the rollout engine takes the actor's weights at every sync",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "the reference policy moves with "
    "actor.offload",
    _ACTOR + "fsdp_config.grad_offload": "gradients move with actor.offload",
    "data.val_batch_size": "validation generates every held-out prompt in one batch",
}
"""verl keys accepted with a line saying they change nothing here, and why."""

_VERL_SECTIONS = (
    "actor_rollout_ref.",
    "critic.",
    "reward_model.",
    "ray_kwargs.",
    "global_profiler.",
)
# verl keys in sections both share, for features rlwire-train does not have
_VERL_SHARED = {
    "data.return_raw_chat",
    "algorithm.lam",
    "trainer.critic_warmup",
}
_BY_KEY = {a.verl: a for a in ALIASES}
_PREFIXES = (("async_training.", "async."),)


def _off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {})


def _combine(flat: dict[str, Any], out: dict[str, Any]) -> None:
    """The verl keys that make one of ours (taken out of ``flat``)."""
    use, coef, kind = (flat.pop(k, None) for k in _COMBINED[0][0])
    if use is not None or coef is not None or kind is not None:
        if kind not in (None, "low_var_kl"):
            raise ConfigError(
                f"{_COMBINED[0][0][2]}: {kind!r} is not allowed; rlwire-train's KL loss is "
                "verl's 'low_var_kl' (the k3 estimator)"
            )
        out["algorithm.kl_coef"] = (coef if coef is not None else 0.001) if use else 0.0
    params, optimizer = (flat.pop(k, None) for k in _COMBINED[1][0])
    if params is not None or optimizer is not None:
        if params is not None and optimizer is not None and bool(params) != bool(optimizer):
            raise ConfigError(
                f"{_COMBINED[1][0][0]} and {_COMBINED[1][0][1]}: rlwire-train offloads "
                "parameters and optimizer state together; set both alike"
            )
        out["actor.offload"] = bool(params if params is not None else optimizer)
    path, name = (flat.pop(k, None) for k in _COMBINED[2][0])
    if path:  # verl leaves the path null for its built-in rewards
        out["reward.function"] = f"{path}:{name or 'compute_score'}"
    gpus, nodes = (flat.pop(k, None) for k in _COMBINED[3][0])
    if gpus is not None or nodes is not None:
        for key, value in zip(_COMBINED[3][0], (gpus, nodes), strict=True):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"{key}: {value!r} is not allowed; use an int >= 1")
        out["actor.world_size"] = (gpus or 1) * (nodes or 1)


def _world_to_workers(flat: Mapping[str, Any], out: dict[str, Any]) -> None:
    """verl's rollout runs on every GPU: with ``trainer.n_gpus_per_node`` given and
    ``rollout.num_workers`` not, one rollout engine per tensor-parallel group."""
    if "actor.world_size" not in out or "rollout.num_workers" in out:
        return
    if not any(k in flat for k in _COMBINED[3][0]):
        return
    tp = out.get("rollout.vllm.tensor_parallel_size", 1)
    if isinstance(tp, int) and tp >= 1 and out["actor.world_size"] % tp == 0:
        out["rollout.num_workers"] = out["actor.world_size"] // tp


def translate(flat: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Dotted keys with verl's replaced by ours, the problems found (verl keys for missing
    features, values a key does not allow: all of them, a line each) and the notes (verl
    keys accepted that change nothing here)."""
    given_flat = dict(flat)
    flat = dict(flat)
    out: dict[str, Any] = {}
    problems: list[str] = []
    notes: list[str] = []
    try:
        _combine(flat, out)
    except ConfigError as err:
        problems.append(str(err))
    given: dict[str, str] = {}  # our key -> the key that set it

    def put(ours: str, value: Any, source: str) -> None:
        """``ours`` from ``source``; two spellings of one key must agree."""
        if ours in given and out[ours] != value:
            problems.append(
                f"{given[ours]}={out[ours]!r} and {source}={value!r} both set {ours}; "
                "give one value"
            )
        given[ours], out[ours] = source, value

    for keys, ours, _ in _COMBINED:
        if ours in out:
            given[ours] = " and ".join(k for k in keys if k in given_flat)
    refused = []
    for key, value in flat.items():
        given_key = key
        for theirs, ours in _PREFIXES:
            if key.startswith(theirs):
                key = ours + key.removeprefix(theirs)
        alias = _BY_KEY.get(key)
        if key in NO_EFFECT:
            notes.append(f"{key}={value!r} changes nothing here: {NO_EFFECT[key]}")
        elif alias is not None:
            try:
                converted = alias.convert(key, value)
            except ConfigError as err:
                problems.append(str(err))
                continue
            if alias.ours and converted is not None:  # None: nothing to set
                put(alias.ours, converted, given_key)
        elif key.startswith(_VERL_SECTIONS) or key in _VERL_SHARED:
            if not _off(value):
                refused.append(f"{key}={value!r}")
        else:
            put(key, value, given_key)
    _world_to_workers(given_flat, out)
    if refused:
        problems.append(
            f"verl keys for features rlwire-train does not have: {', '.join(refused)}; remove "
            "them (or set them off: false, null or 0). The mapped keys: "
            "docs/integrations/verl.md (verl's keys)"
        )
    return out, problems, notes


def alias_table() -> str:
    """The README's Markdown table: verl key -> rlwire key."""
    rows = ["| verl key | rlwire key | note |", "|---|---|---|"]
    for a in ALIASES:
        rows.append(f"| `{a.verl}` | {f'`{a.ours}`' if a.ours else '(checked only)'} | {a.note} |")
    for keys, ours, note in _COMBINED:
        rows.append(f"| {', '.join(f'`{k}`' for k in keys)} | `{ours}` | {note} |")
    for key, why in NO_EFFECT.items():
        rows.append(f"| `{key}` | (accepted: changes nothing) | {why} |")
    for theirs, ours in _PREFIXES:
        rows.append(f"| `{theirs}*` | `{ours}*` | the same keys |")
    return "\n".join(rows) + "\n"
