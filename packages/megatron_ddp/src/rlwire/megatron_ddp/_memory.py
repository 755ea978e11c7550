"""Bytes per parameter of Megatron-Core DDP + optimizer state, and consistency warnings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

from ._resolve import _as_dict, effective_optimizer_settings, parse_dtype

__all__ = [
    "MemoryBreakdown",
    "check_consistency",
    "grad_buffer_numel",
    "grad_memory_bytes_per_param",
]

_ADAM = ("adam", "adamw")
_SGD = ("sgd",)


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes per model parameter on one data-parallel rank.

    Persistent fields live for the whole run; ``transient_main_grads`` exists
    only during the optimizer step (a copy of gradients into the optimizer's
    main-grad dtype). Sharded terms are already divided by the data-parallel
    size when the distributed optimizer is on.
    """

    param: float
    """The model parameter itself (``param_dtype``)."""
    grad_buffer: float
    """Megatron DDP's contiguous gradient buffer: fp32 if ``grad_reduce_in_fp32``
    else ``param_dtype``; never sharded (every rank holds all of it)."""
    main_grads: float
    """Persistent main gradients separate from the buffer (0 in every mode
    Megatron-Core ships: main grads are views of the buffer or transient)."""
    master_params: float
    """Optimizer master copy of the parameters (fp32, or ``main_params_dtype``
    for a precision-aware optimizer, 2 B when it stores only the bf16
    remainders); 0 when the parameters already are fp32."""
    optimizer_moments: float
    """Optimizer state: Adam's two moments, SGD's momentum buffer."""
    transient_main_grads: float
    """Extra main-grad copy made at the step when the buffer's dtype is not the
    main-grad dtype (the bf16 buffer + conventional optimizer case)."""

    @property
    def persistent(self) -> float:
        return (
            self.param
            + self.grad_buffer
            + self.main_grads
            + self.master_params
            + self.optimizer_moments
        )

    @property
    def total(self) -> float:
        """Peak bytes per parameter: persistent plus the step's transient copy."""
        return self.persistent + self.transient_main_grads


def _ddp_fields(ddp_config: Any) -> dict[str, Any]:
    fields = _as_dict(ddp_config, what="ddp_config")
    return {
        "grad_reduce_in_fp32": bool(fields.get("grad_reduce_in_fp32", False)),
        "use_distributed_optimizer": bool(fields.get("use_distributed_optimizer", False)),
    }


def grad_memory_bytes_per_param(
    *, param_dtype: Any, ddp_config: Any, optimizer_config: Any, dp_size: int
) -> MemoryBreakdown:
    """Bytes per parameter for Megatron-Core DDP with its optimizer, on one rank.

    Args:
        param_dtype: the model's parameter dtype (``torch.bfloat16`` or a string).
        ddp_config: a ``DistributedDataParallelConfig``, mapping or object;
            reads ``grad_reduce_in_fp32`` and ``use_distributed_optimizer``
            (Megatron defaults: False, False).
        optimizer_config: an ``OptimizerConfig``, mapping or object (Megatron
            defaults for missing fields); ``use_distributed_optimizer`` is taken
            from the DDP config, where Megatron acts on it.
        dp_size: data-parallel world size ``d`` (shards optimizer state when the
            distributed optimizer is on).

    Reference points (bf16 parameters, Adam): conventional optimizer, fp32
    grad buffer, distributed optimizer: ``2 + 4 + 12/d = 6 + 12/d``. Same with a
    bf16 grad buffer: ``4 + 12/d`` persistent plus a transient ``4/d`` fp32
    main-grad copy at every step.

    Raises:
        ValueError: bad ``dp_size``, dtype, or an optimizer other than Adam/SGD.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size: {dp_size!r} is not allowed; use an int >= 1")
    pdtype = parse_dtype(param_dtype, field="param_dtype")
    ddp = _ddp_fields(ddp_config)
    opt = effective_optimizer_settings(optimizer_config)
    name = str(opt["optimizer"]).lower()
    if name not in _ADAM + _SGD:
        raise ValueError(
            f"optimizer: {opt['optimizer']!r} has no memory model; known: 'adam', 'sgd'"
        )
    shard = dp_size if ddp["use_distributed_optimizer"] else 1
    grad_dtype = torch.float32 if ddp["grad_reduce_in_fp32"] else pdtype
    precision_aware = bool(opt["use_precision_aware_optimizer"])

    if precision_aware:
        main_grad_dtype = opt["main_grads_dtype"]
        master_dtype = opt["main_params_dtype"]
        master = master_dtype.itemsize
        if (
            opt["store_param_remainders"]
            and master_dtype == torch.float32
            and pdtype == torch.bfloat16
        ):
            master = 2  # fp32 master = bf16 param + 16 stored remainder bits
        moments = opt["exp_avg_dtype"].itemsize + opt["exp_avg_sq_dtype"].itemsize
    else:
        main_grad_dtype = torch.float32
        master = 0 if pdtype == torch.float32 else 4
        moments = 8
    if name in _SGD:
        moments = 4 if opt["sgd_momentum"] else 0
    transient = 0.0 if grad_dtype == main_grad_dtype else main_grad_dtype.itemsize / shard
    return MemoryBreakdown(
        param=float(pdtype.itemsize),
        grad_buffer=float(grad_dtype.itemsize),
        main_grads=0.0,
        master_params=master / shard,
        optimizer_moments=moments / shard,
        transient_main_grads=transient,
    )


def grad_buffer_numel(
    param_numels: Iterable[int], *, dp_size: int, use_distributed_optimizer: bool
) -> int:
    """Elements in Megatron DDP's gradient buffer for one bucket of parameters.

    Without the distributed optimizer the buffer is exactly the parameters.
    With it, Megatron aligns each parameter's start to 64 elements (128-byte
    addresses at 16 bits) and pads the bucket's end to a multiple of
    ``lcm(dp_size, 128)`` so it shards evenly; this reproduces that padding for
    a single bucket (``overlap_grad_reduce=False``, Megatron's default).
    """
    numels = list(param_numels)
    if not use_distributed_optimizer:
        return sum(numels)
    end = 0
    for numel in reversed(numels):  # Megatron lays parameters out in reverse order
        end = math.ceil(end / 64) * 64 + numel
    divisor = math.lcm(dp_size, 128)
    return math.ceil(end / divisor) * divisor


def check_consistency(ddp_config: Any, optimizer_config: Any) -> list[str]:
    """Warnings for DDP/optimizer combinations that waste memory or change numerics.

    Returns an empty list for consistent settings. Each warning says what
    happens and how to fix it.
    """
    ddp = _ddp_fields(ddp_config)
    ddp_raw = _as_dict(ddp_config, what="ddp_config")
    opt_raw = _as_dict(optimizer_config, what="optimizer_config")
    opt = effective_optimizer_settings(optimizer_config)
    warnings: list[str] = []
    precision_aware = bool(opt["use_precision_aware_optimizer"])
    main_grads = opt["main_grads_dtype"]
    if not ddp["grad_reduce_in_fp32"] and not precision_aware:
        warnings.append(
            "grad_reduce_in_fp32=False with the conventional optimizer: gradients are "
            "reduced in the parameter dtype and the optimizer allocates an fp32 main-grad "
            "copy at every step next to the low-precision buffer (memory paid twice, lower "
            "precision reduction); set grad_reduce_in_fp32=True"
        )
    if precision_aware and main_grads != torch.float32 and ddp["grad_reduce_in_fp32"]:
        warnings.append(
            f"grad_reduce_in_fp32=True with a precision-aware optimizer whose main_grads_dtype "
            f"is {main_grads}: the fp32 buffer is twice the size the optimizer uses and is "
            "cast down at every step; set grad_reduce_in_fp32=False"
        )
    if precision_aware and main_grads == torch.float32 and not ddp["grad_reduce_in_fp32"]:
        warnings.append(
            "grad_reduce_in_fp32=False while the precision-aware optimizer wants fp32 main "
            "grads: gradients lose precision in the reduction and are upcast afterwards; set "
            "grad_reduce_in_fp32=True"
        )
    if precision_aware and not ddp["use_distributed_optimizer"]:
        warnings.append(
            "use_precision_aware_optimizer requires the distributed optimizer; set "
            "use_distributed_optimizer=True in the DDP config"
        )
    opt_dist = opt_raw.get("use_distributed_optimizer")
    if (
        opt_dist is not None
        and "use_distributed_optimizer" in ddp_raw
        and (bool(opt_dist) != ddp["use_distributed_optimizer"])
    ):
        warnings.append(
            f"use_distributed_optimizer differs: DDP config {ddp['use_distributed_optimizer']}, "
            f"optimizer config {bool(opt_dist)}; Megatron shards gradients by the DDP value, "
            "so set both the same"
        )
    return warnings
