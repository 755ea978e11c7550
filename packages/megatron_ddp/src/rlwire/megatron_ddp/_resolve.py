"""Resolve Megatron-Core DDP overrides from the optimizer's effective precision.

Megatron-Core's ``DistributedDataParallelConfig.grad_reduce_in_fp32`` defaults to
False: the gradient buffer is then in the parameter dtype (bf16). The
conventional optimizer wants fp32 main gradients, so at every step it allocates
an fp32 copy of the gradients next to the bf16 buffer: memory paid twice, and a
bf16 reduction on top. The rule here: reduce in fp32 unless a precision-aware
optimizer explicitly asks for sub-fp32 main gradients; an explicit user setting
always wins.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    # megatron-core ships no type information: to the checker this name is Any.
    from megatron.core.distributed import DistributedDataParallelConfig

__all__ = [
    "OPTIMIZER_DEFAULTS",
    "build_ddp_config",
    "effective_optimizer_settings",
    "is_muon_layer_wise",
    "parse_dtype",
    "resolve_ddp_overrides",
]

logger = logging.getLogger("rlwire.megatron_ddp")

# Every spelling Megatron-LM's arguments and verl's precision parsing accept. "fp8" is
# torch.uint8: the dtype Megatron maps fp8 optimizer states to.
_DTYPES: dict[str | int, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
    32: torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "16": torch.float16,
    16: torch.float16,
    "fp8": torch.uint8,
}
_ACCEPTED = "torch.float32/bfloat16/float16/uint8 or " + ", ".join(repr(k) for k in _DTYPES)

# Megatron-Core's OptimizerConfig defaults for the fields this package reads.
# A field missing from the caller's config takes the value here.
OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "optimizer": "adam",
    "use_precision_aware_optimizer": False,
    "use_distributed_optimizer": False,
    "main_grads_dtype": torch.float32,
    "main_params_dtype": torch.float32,
    "exp_avg_dtype": torch.float32,
    "exp_avg_sq_dtype": torch.float32,
    "store_param_remainders": True,
    "bf16": False,
    "fp16": False,
    "sgd_momentum": 0.9,
    # Not an OptimizerConfig field in megatron-core 0.16; Megatron passes it as
    # an argument to its Muon factory. Accepted here so callers can state it.
    "layer_wise_distributed_optimizer": False,
    # verl's name for the same switch (its Megatron optimizer config).
    "use_layer_wise_distributed_optimizer": False,
}
_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
_LAYOUT_KEY = "use_layer_wise_param_layout"


def parse_dtype(value: Any, *, field: str) -> torch.dtype:
    """``value`` as a ``torch.dtype``: a dtype or one of the accepted strings.

    Raises:
        ValueError: names ``field``, the value and the accepted values.
    """
    if isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    if isinstance(value, str) and value.strip().lower() in _DTYPES:
        return _DTYPES[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in _DTYPES:
        return _DTYPES[value]
    raise ValueError(f"{field}: {value!r} is not an accepted dtype; accepted: {_ACCEPTED}")


def _as_dict(config: Any, *, what: str) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if hasattr(config, "__dict__"):
        return {k: v for k, v in vars(config).items() if not k.startswith("_")}
    raise TypeError(
        f"{what} must be a mapping, a dataclass or an object with attributes; "
        f"got {type(config).__name__}"
    )


def effective_optimizer_settings(
    optimizer_config: Any, optimizer_overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The optimizer fields this package reads, after merging overrides on top.

    Missing fields take Megatron-Core's defaults (:data:`OPTIMIZER_DEFAULTS`);
    dtype fields are normalised to ``torch.dtype`` (any spelling :func:`parse_dtype`
    accepts) when the precision-aware optimizer is on, and are ``torch.float32``
    otherwise, as Megatron uses them.

    Raises:
        ValueError: a dtype is not accepted, or ``optimizer_overrides`` names a
            field that a dataclass ``optimizer_config`` does not have.
    """
    base = _as_dict(optimizer_config, what="optimizer_config")
    overrides = dict(optimizer_overrides or {})
    if overrides and dataclasses.is_dataclass(optimizer_config):
        valid = {f.name for f in dataclasses.fields(optimizer_config)}
        unknown = sorted(set(overrides) - valid - set(OPTIMIZER_DEFAULTS))
        if unknown:
            raise ValueError(
                f"optimizer_overrides: unknown field(s) {unknown} for "
                f"{type(optimizer_config).__name__}; valid: {sorted(valid)}"
            )
    merged = {**OPTIMIZER_DEFAULTS, **base, **overrides}
    for name in _DTYPE_FIELDS:
        # Only a precision-aware optimizer reads these (Megatron requires fp32 otherwise,
        # and verl passes them on only then): elsewhere they are fp32, whatever was set.
        if merged["use_precision_aware_optimizer"]:
            merged[name] = parse_dtype(merged[name], field=name)
        else:
            merged[name] = torch.float32
    return merged


def is_muon_layer_wise(settings: Mapping[str, Any]) -> bool:
    """Whether effective optimizer settings select Muon with the layer-wise distributed optimizer.

    Recognised exactly when (case-insensitive ``optimizer`` name):

    - ``optimizer == "dist_muon"`` (Megatron-LM's name for Muon with its
      ``LayerWiseDistributedOptimizer``), or
    - ``optimizer == "muon"`` and ``layer_wise_distributed_optimizer`` (the
      argument of megatron-core's Muon factory) or
      ``use_layer_wise_distributed_optimizer`` (verl's field) is True, or
    - ``optimizer == "muon"`` and ``use_distributed_optimizer`` is True: Muon
      needs whole matrices, so Megatron distributes it layer-wise, never by
      element ranges.
    """
    name = str(settings.get("optimizer", "")).strip().lower()
    if name == "dist_muon":
        return True
    return name == "muon" and bool(
        settings.get("layer_wise_distributed_optimizer")
        or settings.get("use_layer_wise_distributed_optimizer")
        or settings.get("use_distributed_optimizer")
    )


def resolve_ddp_overrides(
    optimizer_config: Any,
    override_ddp_config: Mapping[str, Any] | None = None,
    *,
    optimizer_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """DDP config overrides with the gradient-reduction dtype resolved.

    Args:
        optimizer_config: a Megatron ``OptimizerConfig``, a mapping, any object
            with attributes, or ``None`` for a forward-only engine (then the
            overrides are returned as a copy with nothing injected).
        override_ddp_config: the user's ``DistributedDataParallelConfig``
            fields. Never mutated.
        optimizer_overrides: fields merged on top of ``optimizer_config``
            before resolving, as trainers do with a base config plus user
            overrides; the precision-aware flag and dtypes are read after the
            merge.

    Returns:
        A new dict: the overrides, plus ``grad_reduce_in_fp32 = not
        (use_precision_aware_optimizer and main_grads_dtype != fp32)`` unless
        the overrides set it explicitly, plus ``use_layer_wise_param_layout=True``
        (as a default only) for Muon with the layer-wise distributed optimizer
        (see :func:`is_muon_layer_wise`).

    Raises:
        ValueError: a dtype field is not an accepted dtype.
    """
    resolved = dict(override_ddp_config or {})
    if optimizer_config is None:
        return resolved
    settings = effective_optimizer_settings(optimizer_config, optimizer_overrides)
    if "grad_reduce_in_fp32" not in resolved:
        low_precision_main_grads = (
            settings["use_precision_aware_optimizer"]
            and settings["main_grads_dtype"] != torch.float32
        )
        resolved["grad_reduce_in_fp32"] = not low_precision_main_grads
    if is_muon_layer_wise(settings):
        resolved.setdefault(_LAYOUT_KEY, True)
    return resolved


def build_ddp_config(
    optimizer_config: Any,
    override_ddp_config: Mapping[str, Any] | None = None,
    *,
    optimizer_overrides: Mapping[str, Any] | None = None,
    **base: Any,
) -> DistributedDataParallelConfig:
    """A real ``megatron.core.distributed.DistributedDataParallelConfig``, resolved.

    ``base`` holds the caller's own DDP fields (e.g. ``use_distributed_optimizer``),
    ``override_ddp_config`` the user's; the user's win, then
    :func:`resolve_ddp_overrides` fills in the gradient dtype.

    Raises:
        ValueError: a user-supplied key (in ``base`` or ``override_ddp_config``)
            is not a field of the installed ``DistributedDataParallelConfig``;
            the message lists the valid names. A key this resolver derived that
            the installed megatron-core does not know (the Muon layout key on
            megatron-core 0.16) is dropped with one warning instead.
        ImportError: megatron-core is not installed (with the install command).
    """
    DistributedDataParallelConfig = _import_ddp_config()
    valid = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    user = {**base, **dict(override_ddp_config or {})}
    unknown = sorted(set(user) - valid)
    if unknown:
        raise ValueError(
            f"override_ddp_config: unknown DistributedDataParallelConfig field(s) {unknown}; "
            f"valid: {sorted(valid)}"
        )
    resolved = resolve_ddp_overrides(
        optimizer_config, user, optimizer_overrides=optimizer_overrides
    )
    for key in sorted(set(resolved) - valid):
        logger.warning(
            "megatron-core %s has no DistributedDataParallelConfig.%s; dropping the derived "
            "value %r",
            _megatron_version(),
            key,
            resolved.pop(key),
        )
    return DistributedDataParallelConfig(**resolved)


def _import_ddp_config() -> Any:  # the class; megatron-core ships no type information
    try:
        from megatron.core.distributed import DistributedDataParallelConfig
    except ImportError as err:
        raise ImportError(
            "rlwire.megatron_ddp.build_ddp_config needs megatron-core: "
            "pip install 'megatron-core>=0.12'"
        ) from err
    return DistributedDataParallelConfig


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "(unknown version)"
