"""Non-blocking model and optimizer offload through reusable pinned host buffers.

Colocated RL moves the actor between accelerator and host several times per
step. This package copies on a side stream into page-locked buffers that are
allocated once and reused, keeps parameter identity, and returns an explicit
completion handle (:class:`Transfer`): host memory is safe to read only after
``wait()``. The pool can be prepared ahead (:func:`prepare_model`), in chunks and
on a background thread, so that page-locking leaves the first offload's critical
path. Without an accelerator every call is a cheap no-op.
"""

from __future__ import annotations

from ._offload import load_model, load_optimizer, offload_model, offload_optimizer
from ._pool import PinnedPool, PoolStats, default_pool
from ._preparation import Preparation
from ._prepare import prepare_model, prepare_optimizer
from ._transfer import Transfer

__all__ = [
    "PinnedPool",
    "PoolStats",
    "Preparation",
    "Transfer",
    "default_pool",
    "load_model",
    "load_optimizer",
    "offload_model",
    "offload_optimizer",
    "prepare_model",
    "prepare_optimizer",
]
