"""Prepare a pool ahead: the exact buffers an offload of a model or optimizer will reserve."""

from __future__ import annotations

import torch
from torch import nn

from ._layout import chunked_layout
from ._offload import _GRAD_MODES
from ._pool import PinnedPool, default_pool
from ._preparation import Preparation
from ._slots import Slot, module_slots, optimizer_slots

__all__ = ["prepare_model", "prepare_optimizer"]


def _prepare(
    slots: list[Slot], *, pool: PinnedPool | None, what: str, include_host: bool
) -> Preparation:
    moving = [s.tensor for s in slots if include_host or s.tensor.device.type != "cpu"]
    if not moving:
        return Preparation.completed(f"{what} (nothing on an accelerator)")
    pool = pool or default_pool()
    sizes = [chunk.nbytes for chunk in chunked_layout(moving, pool.chunk_bytes)]
    return pool.prepare(sizes)


def prepare_model(
    model: nn.Module,
    *,
    grads: str = "drop",
    pool: PinnedPool | None = None,
    _include_host: bool = False,
) -> Preparation:
    """Allocate and page-lock, in the background, the host buffers :func:`offload_model` will use.

    Page-locking is the first offload's whole cost (about 1 GB/s against tens
    of GB/s for the copy). This computes the exact buffers an offload of
    ``model`` will reserve (its tensors packed into ``pool.chunk_bytes``
    buffers) and has ``pool`` (default: the process's pool) allocate the ones
    its free buffers do not already cover, on a background thread. Call it at
    start-up and ``wait()`` on the handle, or call it while the accelerator
    computes and let the offload take the buffers as they come (it waits only
    for those still being page-locked). Nothing about ``model`` changes
    (FSDP2 modules are not resharded).

    Args:
        grads: the ``grads`` the offload will use: ``"keep"`` counts the
            gradients that exist now (prepare after the first backward).
        _include_host: count tensors already in host memory too (see
            :func:`offload_model`).

    Returns:
        A :class:`Preparation`; a completed one with ``nbytes == 0`` when
        nothing is on an accelerator or the pool already holds the buffers.
    """
    if grads not in _GRAD_MODES:
        raise ValueError(f"grads: {grads!r} is not allowed; use one of {_GRAD_MODES}")
    params, grad_slots = module_slots(model, grads=grads == "keep", reshard=False)
    return _prepare(
        params + grad_slots, pool=pool, what="prepare_model", include_host=_include_host
    )


def prepare_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    pool: PinnedPool | None = None,
    _include_host: bool = False,
) -> Preparation:
    """The same as :func:`prepare_model` for :func:`offload_optimizer`'s buffers.

    Optimizer state exists only after the first ``step()`` (Adam's moments):
    prepare after it, or size the pool yourself with :meth:`PinnedPool.prepare`.
    """
    return _prepare(
        optimizer_slots(optimizer), pool=pool, what="prepare_optimizer", include_host=_include_host
    )
