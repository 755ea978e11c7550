"""Megatron-Core DDP gradient dtype, resolved from the optimizer's precision.

fp32 gradient reduction by default; low-precision reduction only when a
precision-aware optimizer explicitly asks for sub-fp32 main gradients; an
explicit user setting always wins. Plus a bytes-per-parameter memory model
checked against real Megatron-Core buffers. megatron-core is imported lazily
(only :func:`build_ddp_config` needs it).
"""

from __future__ import annotations

from ._memory import (
    MemoryBreakdown,
    check_consistency,
    grad_buffer_numel,
    grad_memory_bytes_per_param,
)
from ._resolve import (
    build_ddp_config,
    effective_optimizer_settings,
    is_muon_layer_wise,
    parse_dtype,
    resolve_ddp_overrides,
)

__all__ = [
    "MemoryBreakdown",
    "build_ddp_config",
    "check_consistency",
    "effective_optimizer_settings",
    "grad_buffer_numel",
    "grad_memory_bytes_per_param",
    "is_muon_layer_wise",
    "parse_dtype",
    "resolve_ddp_overrides",
]
