"""Applying the policy to micro-batches, deciding AUTO, and the retained-memory figures."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from ._policy import GradSyncPolicy, resolve_config
from ._wrappers import (
    data_parallel_groups,
    measure_retained_bytes,
    no_sync_context,
    predict_deferred_bytes,
)

__all__ = [
    "decide_policy",
    "micro_batch_sync",
    "predict_retained_grad_bytes",
    "retained_grad_bytes",
    "run_micro_batches",
]

logger = logging.getLogger("rlwire.grad_sync")

T = TypeVar("T")
R = TypeVar("R")

# With no explicit budget, AUTO lets deferred gradients take at most this
# fraction of the accelerator's free memory: the rest is left to activations,
# which grow with micro-batch size and are not known when the decision is made.
AUTO_FREE_MEMORY_FRACTION = 0.5

# model -> {budget: decision}; weak so that deciding never keeps a model alive.
_decisions: weakref.WeakKeyDictionary[nn.Module, dict[int | None, GradSyncPolicy]] = (
    weakref.WeakKeyDictionary()
)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _default_budget(device: torch.device) -> int | None:
    if device.type in ("cpu", "meta"):
        return None
    backend = getattr(torch, device.type, None)
    mem_get_info = getattr(backend, "mem_get_info", None)
    if mem_get_info is None:
        return None
    free, _total = mem_get_info(device)
    return int(free * AUTO_FREE_MEMORY_FRACTION)


# A rank with no budget (a CPU model, no memory_budget_bytes) sets no limit.
_NO_BUDGET = torch.iinfo(torch.int64).max


def _agreed_budget(model: nn.Module, budget: int | None) -> int | None:
    """The smallest budget over every rank that reduces ``model``'s gradients.

    Ranks must choose the same policy (a rank deferring while another syncs issues
    mismatched collectives: a hang or wrong gradients), but each has its own free
    memory and maybe its own configured budget. One all-reduce (MIN) per group.
    """
    import torch.distributed as dist

    groups = data_parallel_groups(model) if dist.is_available() and dist.is_initialized() else []
    if not groups:
        return budget
    device = _model_device(model)
    if device.type == "meta":
        device = torch.device("cpu")
    value = torch.tensor([_NO_BUDGET if budget is None else budget], device=device)
    for group in groups:
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    agreed = int(value.item())
    return None if agreed == _NO_BUDGET else agreed


def decide_policy(model: nn.Module, config: Any = None) -> GradSyncPolicy:
    """The concrete policy (``DEFER`` or ``EVERY``) to use for ``model``.

    ``DEFER`` and ``EVERY`` are returned as they are. ``AUTO`` compares
    :func:`predict_retained_grad_bytes` under ``DEFER`` with the budget:
    ``config.memory_budget_bytes`` if set, else
    ``AUTO_FREE_MEMORY_FRACTION`` of the free memory of the device holding the
    model's parameters. On a CPU model with no budget it is ``DEFER``. The
    decision is made once per model and budget, and logged at INFO on the
    ``rlwire.grad_sync`` logger.

    Under a data-parallel wrapper (FSDP2, FSDP1, DDP) every rank of its groups gets
    the same answer: the ranks agree on the smallest budget among them with one
    all-reduce per group, so for ``AUTO`` the first call is a collective that every
    rank must make (as the micro-batch loop does).

    Args:
        model: the wrapped model (FSDP2, FSDP1, DDP or plain).
        config: anything :func:`resolve_policy` accepts, or a :class:`GradSyncConfig`.
    """
    cfg = resolve_config(config)
    if cfg.policy is not GradSyncPolicy.AUTO:
        return cfg.policy
    decided = _decisions.setdefault(model, {})
    key = cfg.memory_budget_bytes
    if key in decided:
        return decided[key]
    budget = cfg.memory_budget_bytes
    source = "memory_budget_bytes"
    if budget is None:
        budget = _default_budget(_model_device(model))
        source = f"{AUTO_FREE_MEMORY_FRACTION:g} x free device memory"
    agreed = _agreed_budget(model, budget)
    if agreed != budget:
        budget, source = agreed, "the smallest budget among the data-parallel ranks"
    predicted = predict_deferred_bytes(model)
    if budget is None:
        choice, reason = GradSyncPolicy.DEFER, "CPU model and no memory budget"
    elif predicted <= budget:
        choice, reason = GradSyncPolicy.DEFER, f"{predicted} B retained <= {budget} B ({source})"
    else:
        choice, reason = GradSyncPolicy.EVERY, f"{predicted} B retained > {budget} B ({source})"
    logger.info("grad_sync auto -> %s for %s: %s", choice.value, type(model).__name__, reason)
    decided[key] = choice
    return choice


def micro_batch_sync(
    model: nn.Module,
    *,
    is_last: bool,
    policy: Any = GradSyncPolicy.DEFER,
    forward_only: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """Context manager around one micro-batch's forward and backward.

    Gradient synchronisation is disabled only when the policy defers, this is
    not the last micro-batch, and the pass computes gradients. The final
    micro-batch therefore always reduces everything accumulated so far, and a
    forward-only pass (log-prob computation) never leaves sync disabled.

    Supports FSDP2 (``fully_shard``: ``set_requires_gradient_sync``, previous
    flags restored even when the body raises), FSDP1 and
    ``DistributedDataParallel`` (``no_sync()``), any wrapper with a ``no_sync()``
    context manager, and plain modules (no-op).

    Args:
        model: the wrapped model.
        is_last: whether this is the final micro-batch of the optimizer step.
        policy: a :class:`GradSyncPolicy`, its string, a :class:`GradSyncConfig`
            or anything :func:`resolve_policy` accepts; ``AUTO`` is decided
            with :func:`decide_policy`.
        forward_only: the pass computes no gradients.
    """
    if is_last or forward_only or decide_policy(model, policy) is GradSyncPolicy.EVERY:
        return contextlib.nullcontext()
    return no_sync_context(model)


def _with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        raise ValueError("micro_batches is empty; one optimizer step needs at least one") from None
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def run_micro_batches(
    model: nn.Module,
    micro_batches: Iterable[T],
    step_fn: Callable[[T], R],
    *,
    policy: Any = GradSyncPolicy.DEFER,
    forward_only: bool = False,
) -> list[R]:
    """Call ``step_fn(micro_batch)`` for each micro-batch inside :func:`micro_batch_sync`.

    ``micro_batches`` may be any iterable (a generator too: the last item is
    found by looking one ahead). ``step_fn`` runs forward and, unless
    ``forward_only``, backward. Returns the results in order.

    Raises:
        ValueError: ``micro_batches`` is empty.
    """
    concrete = decide_policy(model, policy)
    results: list[R] = []
    for batch, is_last in _with_last(micro_batches):
        with micro_batch_sync(model, is_last=is_last, policy=concrete, forward_only=forward_only):
            results.append(step_fn(batch))
    return results


def retained_grad_bytes(model: nn.Module) -> int:
    """Bytes of gradient state ``model`` holds now *because* synchronisation was deferred.

    FSDP2: the unsharded gradients accumulated on the unsharded parameters (in
    the reduce dtype when it is wider than the compute dtype). FSDP1: the
    unsharded flat-parameter gradients held under ``no_sync``. DDP and plain
    modules: 0 (deferral keeps the same ``.grad`` tensors). After the final,
    synchronised micro-batch it is 0 again.
    """
    return measure_retained_bytes(model)


def predict_retained_grad_bytes(model: nn.Module, *, policy: Any = GradSyncPolicy.DEFER) -> int:
    """:func:`retained_grad_bytes` between micro-batches, predicted before running anything.

    Computed from the full (unsharded) parameter counts and the wrapper's
    dtypes: for FSDP2 the reduce dtype if it is wider than the parameter
    (compute) dtype, else the compute dtype; for FSDP1 the forward/backward
    parameter dtype. 0 for ``EVERY``, for DDP and for plain modules. ``AUTO`` is
    first decided with :func:`decide_policy`.
    """
    if decide_policy(model, policy) is GradSyncPolicy.EVERY:
        return 0
    return predict_deferred_bytes(model)
