"""Gradient-synchronisation policy for micro-batch gradient accumulation.

Deferring the data-parallel reduction to the last micro-batch saves ``M - 1``
reductions per step but keeps an unsharded gradient of the whole model alive
between micro-batches. This package makes that trade-off an explicit policy,
applies it to FSDP2, FSDP1, DDP and plain modules, and measures and predicts
the memory it costs.
"""

from __future__ import annotations

from ._policy import GradSyncConfig, GradSyncPolicy, resolve_policy
from ._sync import (
    decide_policy,
    micro_batch_sync,
    predict_retained_grad_bytes,
    retained_grad_bytes,
    run_micro_batches,
)

__all__ = [
    "GradSyncConfig",
    "GradSyncPolicy",
    "decide_policy",
    "micro_batch_sync",
    "predict_retained_grad_bytes",
    "resolve_policy",
    "retained_grad_bytes",
    "run_micro_batches",
]
