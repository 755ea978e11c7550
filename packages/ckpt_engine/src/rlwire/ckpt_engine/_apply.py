"""Receiving one update straight into a ``torch.nn.Module``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ._base import CheckpointEngine
from ._delta import Delta
from ._errors import CheckpointEngineError

__all__ = ["apply_to_module"]


def _targets(module: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # The state dict's names: persistent buffers included, and tied parameters
    # under each of their names (as a trainer's state_dict() sends them).
    if isinstance(module, nn.Module):
        return module.state_dict(keep_vars=True)
    return dict(module)


def _check(name: str, target: torch.Tensor, value: torch.Tensor | Delta) -> None:
    if tuple(target.shape) != tuple(value.shape) or target.dtype != value.dtype:
        raise CheckpointEngineError(
            f"apply_to_module: {name!r} is {tuple(value.shape)} {value.dtype} in the update "
            f"but {tuple(target.shape)} {target.dtype} in the module"
        )


async def apply_to_module(
    module: nn.Module | Mapping[str, torch.Tensor],
    updates: CheckpointEngine,
    *,
    atomic: bool = True,
    staging: dict[str, torch.Tensor] | None = None,
    version: int | None = None,
    swap: bool = False,
) -> int:
    """Receive one update from ``updates`` into ``module``'s state-dict entries by name.

    The names are those of ``module.state_dict()``: parameters (tied ones under
    each name), and persistent buffers. ``module`` may also be a mapping of names to
    the tensors to receive into (part of a module's parameters, e.g. a LoRA adapter
    under the names its sender uses); every name in it must arrive, as for a module.

    With ``atomic=True`` every tensor is received into a staging copy first and
    the module changes only after the whole update arrived, every name matched
    and (with ``checksum``) every bucket verified: a failure anywhere leaves the
    module untouched, at the cost of one model-sized host copy. With
    ``atomic=False`` tensors are copied in as they arrive (zero-copy views, no
    staging), so a failure can leave the module half-updated.

    ``staging`` (atomic only): a dict the caller keeps across updates; the staging
    copy lives there, allocated on the first update and reused, so later updates
    allocate nothing (fresh host memory costs page faults on every update).

    ``version``: the version ``module`` holds (what the last successful call
    returned), so that an engine with ``delta`` on may send only what changed
    since; a delta is staged as it arrives (positions and values only) and
    written into the module like any tensor, after the whole update arrived
    when ``atomic``. None (default): the update is dense.

    ``swap`` (atomic only): commit by swapping each tensor's storage with its staged
    copy (``tensor.data``; module objects keep their identity) instead of copying it
    in: one pass over the weights less, still all-or-nothing. With ``staging`` the
    module's previous storage becomes the next update's staging. Not for modules whose
    storage is captured elsewhere (CUDA graphs, views of parameters kept by the caller).

    Returns:
        The update's version.

    Raises:
        CheckpointEngineError: names in the update that the module lacks
            (unknown) or module names the update lacks (missing), listed;
            shape or dtype mismatches; and any transfer error.
    """
    targets = _targets(module)
    received: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    reuse = atomic and staging is not None
    deltas: dict[str, Delta] = {}
    with torch.no_grad():
        stream = updates.receive_weights(copy=atomic and not reuse, base_version=version)
        async for name, tensor in stream:
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            if isinstance(tensor, Delta):
                _check(name, target, tensor)
                if atomic:  # it may be a view of the bucket: keep a copy
                    deltas[name] = tensor.clone()
                else:
                    tensor.apply_(target)
                received[name] = target
                continue
            _check(name, target, tensor)
            if reuse:
                kept = staging.get(name)
                if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                    kept = staging[name] = torch.empty_like(tensor, device=target.device)
                kept.copy_(tensor)  # out of the engine's view before the next item
                received[name] = kept
            elif atomic:
                received[name] = tensor
            else:
                target.copy_(tensor)
                received[name] = target
        missing = sorted(set(targets) - set(received))
        if unknown or missing:
            raise CheckpointEngineError(
                f"apply_to_module: update does not match the module; unknown names: "
                f"{sorted(unknown)}; missing names: {missing}"
            )
        if atomic:
            swapped: set[int] = set()
            for name, tensor in received.items():
                target = targets[name]
                if name in deltas:
                    deltas[name].apply_(target)
                elif not swap:
                    target.copy_(tensor)
                elif id(target) not in swapped:  # a tied tensor is swapped once
                    swapped.add(id(target))
                    old, target.data = target.data, tensor
                    if reuse:
                        staging[name] = old
    return updates.last_version
