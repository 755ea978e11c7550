"""The bytes-per-parameter table of the README (``python -m rlwire.megatron_ddp``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._memory import grad_memory_bytes_per_param
from ._resolve import resolve_ddp_overrides

__all__ = ["COMMON_MODES", "memory_table"]

# (label, optimizer fields, DDP fields the trainer sets itself). The gradient
# dtype is filled in by resolve_ddp_overrides, except in the row that shows
# Megatron's own default (grad_reduce_in_fp32=False) for contrast.
COMMON_MODES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "conventional Adam, dist. optimizer, resolved (fp32 buffer)",
        {},
        {"use_distributed_optimizer": True},
    ),
    (
        "conventional Adam, dist. optimizer, Megatron default (bf16 buffer)",
        {},
        {"use_distributed_optimizer": True, "grad_reduce_in_fp32": False},
    ),
    (
        "conventional Adam, no dist. optimizer, resolved (fp32 buffer)",
        {},
        {"use_distributed_optimizer": False},
    ),
    (
        "precision-aware Adam, fp32 main grads, resolved (fp32 buffer)",
        {"use_precision_aware_optimizer": True},
        {"use_distributed_optimizer": True},
    ),
    (
        "precision-aware Adam, bf16 main grads and moments, resolved (bf16 buffer)",
        {
            "use_precision_aware_optimizer": True,
            "main_grads_dtype": "bf16",
            "exp_avg_dtype": "bf16",
            "exp_avg_sq_dtype": "bf16",
        },
        {"use_distributed_optimizer": True},
    ),
]


def _fmt(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


def memory_table(dp_sizes: Sequence[int] = (1, 8, 64), param_dtype: str = "bf16") -> str:
    """A Markdown table of bytes per parameter for :data:`COMMON_MODES`.

    Each row is computed by :func:`grad_memory_bytes_per_param` on the DDP
    config that :func:`resolve_ddp_overrides` produces for that optimizer.
    Cells are ``persistent (+ transient at the step)``.
    """
    header = (
        "| mode | grad reduce | "
        + " | ".join(f"d={d}" for d in dp_sizes)
        + " |\n|---|---|"
        + "---:|" * len(dp_sizes)
    )
    lines = [header]
    for label, optimizer, ddp in COMMON_MODES:
        resolved = resolve_ddp_overrides(optimizer, ddp)
        cells = []
        for d in dp_sizes:
            m = grad_memory_bytes_per_param(
                param_dtype=param_dtype,
                ddp_config=resolved,
                optimizer_config=optimizer,
                dp_size=d,
            )
            cell = _fmt(m.persistent)
            if m.transient_main_grads:
                cell += f" (+{_fmt(m.transient_main_grads)})"
            cells.append(cell)
        reduce = "fp32" if resolved["grad_reduce_in_fp32"] else param_dtype
        lines.append(f"| {label} | {reduce} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
