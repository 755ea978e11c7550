"""Where a model's and an optimizer's tensors live, as swappable slots.

A slot is one tensor holding data plus the way to install a replacement of
the same shape and dtype without changing any object a caller may hold:
``Parameter.data`` for plain parameters and buffers, the local tensor of a
``DTensor``, FSDP2's padded sharded storage (with the ``DTensor`` view into
it), and FSDP1's flat parameter (with its ``_local_shard`` alias and, with
``use_orig_params``, the original parameters' views).

FSDP's private objects (``FSDPParam``, FSDP1's flat-parameter handles) differ across
the torch versions supported (CI's floor 2.11 to the newest), so they are typed
``Any`` here rather than as one version's classes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["Slot", "drop_grads", "module_slots", "optimizer_slots"]

logger = logging.getLogger("rlwire.offload")


@dataclasses.dataclass(slots=True)
class Slot:
    tensor: torch.Tensor
    install: Callable[[torch.Tensor], None]


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    return hasattr(t, "_local_tensor") and hasattr(t, "_spec")


def tensor_slot(t: torch.Tensor) -> Slot:
    """A slot for a plain tensor or a ``DTensor`` (its local tensor)."""
    if _is_dtensor(t):

        def install_local(new: torch.Tensor, owner: DTensor = t) -> None:
            owner._local_tensor = new

        return Slot(t._local_tensor, install_local)

    def install_data(new: torch.Tensor, owner: torch.Tensor = t) -> None:
        owner.data = new

    return Slot(t, install_data)


def _reviewed(view: torch.Tensor, base: torch.Tensor, new_base: torch.Tensor) -> torch.Tensor:
    """``view`` (a view into ``base``) re-created on ``new_base`` (a copy of ``base``)."""
    offset = view.storage_offset() - base.storage_offset()
    return new_base.as_strided(view.size(), view.stride(), new_base.storage_offset() + offset)


def _fsdp2_slots(
    model: nn.Module, grads: bool, managed: set[int], reshard: bool
) -> tuple[list[Slot], list[Slot]]:
    from torch.distributed.fsdp import FSDPModule

    params: list[Slot] = []
    grad_slots: list[Slot] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        # After a forward without backward the root keeps its unsharded parameters
        # registered; offload the sharded storage only, which a reshard puts back.
        if reshard:
            module.reshard()
        state = module._get_fsdp_state()
        groups: list[Any] | None = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch 2.11 (CI's floor) and older: one group per module
            groups = [g for g in [state._fsdp_param_group] if g is not None]
        for group in groups:
            for fp in group.fsdp_params:
                managed.add(id(fp.sharded_param))
                if getattr(fp, "offload_to_cpu", False):
                    logger.info(
                        "rlwire.offload: %s uses FSDP2's CPUOffloadPolicy; its parameters "
                        "already live on the host, skipping",
                        fp._param_fqn or "a parameter",
                    )
                    continue

                def install(new: torch.Tensor, fp: Any = fp) -> None:
                    old_flat, old_local = fp._sharded_param_data, fp.sharded_param._local_tensor
                    fp._sharded_param_data = new
                    fp.sharded_param._local_tensor = _reviewed(old_local, old_flat, new)

                params.append(Slot(fp._sharded_param_data, install))
                grad = fp.sharded_param.grad
                if grads and grad is not None:
                    grad_slots.append(tensor_slot(grad))
    return params, grad_slots


def _fsdp1_handles(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._handle for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]


def _fsdp1_slots(model: nn.Module, grads: bool, managed: set[int]) -> tuple[list[Slot], list[Slot]]:
    params: list[Slot] = []
    grad_slots: list[Slot] = []
    for handle in _fsdp1_handles(model):
        flat = handle.flat_param
        managed.add(id(flat))
        managed.update(id(p) for p in (getattr(flat, "_params", None) or []))
        managed.update(id(p) for p in (getattr(flat, "_shared_params", None) or []))
        if handle._offload_params:
            logger.info(
                "rlwire.offload: an FSDP1 unit uses CPUOffload(offload_params=True); its "
                "parameters already live on the host, skipping"
            )
            continue

        def install(new: torch.Tensor, handle: Any = handle, flat: Any = flat) -> None:
            flat.data = new
            # Every reshard sets flat.data = _local_shard, NO_SHARD (one rank) included:
            # a stale alias would keep the old device memory and revert later writes.
            if hasattr(flat, "_local_shard"):
                flat._local_shard = new
            if handle._use_orig_params:
                if handle.uses_sharded_strategy:
                    handle._use_sharded_views()
                else:
                    handle._use_unsharded_views(as_params=True)

        params.append(Slot(flat.data, install))
        if grads and flat.grad is not None:
            grad = flat.grad

            def install_grad(
                new: torch.Tensor, handle: Any = handle, grad: torch.Tensor = grad
            ) -> None:
                grad.data = new
                if handle._use_orig_params:  # the original parameters' .grad views follow
                    if handle.uses_sharded_strategy:
                        handle._use_sharded_grad_views()
                    else:
                        handle._use_unsharded_grad_views()

            grad_slots.append(Slot(grad, install_grad))
    return params, grad_slots


def module_slots(
    model: nn.Module, *, grads: bool, reshard: bool = True
) -> tuple[list[Slot], list[Slot]]:
    """``(parameter and buffer slots, gradient slots)`` of ``model``.

    Gradient slots are listed only when ``grads`` is True; they must be
    installed after the parameter slots (a gradient follows its parameter's device).
    ``reshard=False`` leaves FSDP2 modules as they are (to size, not to move:
    the sharded storage listed is the same either way).
    """
    managed: set[int] = set()
    params, grad_slots = _fsdp2_slots(model, grads, managed, reshard)
    p1, g1 = _fsdp1_slots(model, grads, managed)
    params += p1
    grad_slots += g1
    for p in model.parameters():
        if id(p) in managed:
            continue
        params.append(tensor_slot(p))
        if grads and p.grad is not None:
            grad_slots.append(tensor_slot(p.grad))
    params += [tensor_slot(b) for b in model.buffers()]
    return params, grad_slots


def drop_grads(model: nn.Module) -> None:
    """Free every gradient of ``model`` (FSDP1 flat parameters included)."""
    for p in model.parameters():
        p.grad = None
    for handle in _fsdp1_handles(model):
        handle.flat_param.grad = None


def optimizer_slots(optimizer: torch.optim.Optimizer) -> list[Slot]:
    """Slots of every tensor in ``optimizer.state`` (moments, steps, ...)."""
    return [
        tensor_slot(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
