"""Receiving one update straight into a ``torch.nn.Module``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ._base import CheckpointEngine
from ._delta import Delta
from ._errors import CheckpointEngineError

__all__ = ["StagedUpdate", "apply_to_module", "stage_update"]


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
    module untouched, at the cost of one model-sized host copy (this is
    :func:`stage_update`, then :meth:`StagedUpdate.commit`). With
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
    if atomic:
        staged = await stage_update(module, updates, staging=staging, version=version, swap=swap)
        return staged.commit()
    targets = _targets(module)
    received: set[str] = set()
    unknown: list[str] = []
    with torch.no_grad():
        async for name, tensor in updates.receive_weights(copy=False, base_version=version):
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            _check(name, target, tensor)
            if isinstance(tensor, Delta):
                tensor.apply_(target)
            else:
                target.copy_(tensor)
            received.add(name)
    _check_names(unknown, set(targets) - received)
    return _received_version(updates)


def _received_version(updates: CheckpointEngine) -> int:
    """The version of the update just consumed whole (``receive_weights`` sets it last)."""
    version = updates.last_version
    assert version is not None, "the engine took part in no update (an inactive rank -1?)"
    return version


class StagedUpdate:
    """One update received in full beside the module it is for, not yet written into it
    (:func:`stage_update`): the module keeps serving its previous weights until
    :meth:`commit`, which is all-or-nothing and needs no communication.

    Not thread-safe against the module's own use: call :meth:`commit` where nothing
    reads the module (between two generations). One commit per handle."""

    def __init__(
        self,
        targets: dict[str, torch.Tensor],
        received: dict[str, torch.Tensor],
        deltas: dict[str, Delta],
        version: int,
        *,
        staging: dict[str, torch.Tensor] | None,
        swap: bool,
    ) -> None:
        self.version = version
        """The update's version (the sender's ``last_version``)."""
        self._targets, self._received, self._deltas = targets, received, deltas
        self._staging, self._swap = staging, swap
        self._committed = False

    @property
    def changed(self) -> set[str]:
        """Names whose tensor the update changes: received whole, or as a delta of at least
        one element (an unchanged tensor travels as an empty delta)."""
        return {n for n in self._received if n not in self._deltas or self._deltas[n].changed}

    def commit(self) -> int:
        """Write the staged update into the module (deltas applied onto the weights it
        holds, which must be the ``version`` given to :func:`stage_update`); its version.

        Raises:
            CheckpointEngineError: on a second commit of the same handle.
        """
        if self._committed:
            raise CheckpointEngineError(f"StagedUpdate.commit: version {self.version} twice")
        self._committed = True
        swapped: set[int] = set()
        with torch.no_grad():
            for name, tensor in self._received.items():
                target = self._targets[name]
                if name in self._deltas:
                    self._deltas[name].apply_(target)
                elif not self._swap:
                    target.copy_(tensor)
                elif id(target) not in swapped:  # a tied tensor is swapped once
                    swapped.add(id(target))
                    old, target.data = target.data, tensor
                    if self._staging is not None:
                        self._staging[name] = old
        return self.version


async def stage_update(
    module: nn.Module | Mapping[str, torch.Tensor],
    updates: CheckpointEngine,
    *,
    staging: dict[str, torch.Tensor] | None = None,
    version: int | None = None,
    swap: bool = False,
) -> StagedUpdate:
    """Receive one whole update from ``updates`` for ``module`` without touching it: the
    first half of ``apply_to_module(atomic=True)``, for a receiver that keeps using the
    module while the update arrives (a rollout engine generating with the weights it
    holds) and writes it in later, at a boundary of its own, with the returned handle's
    :meth:`StagedUpdate.commit`.

    ``staging``, ``version`` and ``swap`` as in :func:`apply_to_module`; ``version``
    must still be what the module holds at commit (commit one update before staging the
    next). Reads nothing of the module but its names, shapes and dtypes, so the module may
    be in use meanwhile (in another thread).

    Raises:
        CheckpointEngineError: as :func:`apply_to_module`; the module is untouched.
    """
    targets = _targets(module)
    received: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    deltas: dict[str, Delta] = {}
    with torch.no_grad():
        stream = updates.receive_weights(copy=staging is None, base_version=version)
        async for name, tensor in stream:
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            _check(name, target, tensor)
            if isinstance(tensor, Delta):  # it may be a view of the bucket: keep a copy
                deltas[name] = tensor.clone()
                received[name] = target
                continue
            if staging is not None:
                kept = staging.get(name)
                if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                    kept = staging[name] = torch.empty_like(tensor, device=target.device)
                kept.copy_(tensor)  # out of the engine's view before the next item
                tensor = kept
            received[name] = tensor
    _check_names(unknown, set(targets) - set(received))
    version = _received_version(updates)
    return StagedUpdate(targets, received, deltas, version, staging=staging, swap=swap)


def _check_names(unknown: list[str], missing: set[str]) -> None:
    if unknown or missing:
        raise CheckpointEngineError(
            f"apply_to_module: update does not match the module; unknown names: "
            f"{sorted(unknown)}; missing names: {sorted(missing)}"
        )
