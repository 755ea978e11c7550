"""What each data-parallel wrapper does with gradients when synchronisation is off.

All knowledge of FSDP2 and FSDP1 internals lives here. FSDP2 exposes a public
switch (``set_requires_gradient_sync``) but no getter and no view of the
gradients it holds, so both are read from its parameter groups; the attribute
names are checked and a missing one raises instead of under-reporting.

FSDP's private objects (parameter groups, ``FSDPParam``, FSDP1's flat-parameter
handles) differ across the torch versions supported (CI's floor 2.11 to the
newest), so they are typed ``Any`` here rather than as one version's classes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

__all__ = [
    "data_parallel_groups",
    "fsdp1_roots",
    "fsdp2_modules",
    "measure_retained_bytes",
    "no_sync_context",
    "predict_deferred_bytes",
]


def fsdp2_modules(model: nn.Module) -> list[FSDPModule]:
    """Every ``fully_shard``-ed module in ``model`` (including ``model``)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp1_roots(model: nn.Module) -> list[FSDP]:
    """The outermost ``FullyShardedDataParallel`` instances in ``model``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    roots: list[FSDP] = []
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDP) and id(module) not in inner:
            roots.append(module)
            inner.update(id(m) for m in module.modules() if m is not module)
    return roots


def data_parallel_groups(model: nn.Module) -> list[ProcessGroup]:
    """The process groups whose ranks reduce ``model``'s gradients together.

    FSDP2: one group per dimension of each parameter group's mesh (HSDP has two);
    FSDP1: the sharding group and, under hybrid sharding, the replication group;
    DDP: its group. Empty for a plain module. Duplicates are removed; order is the
    same on every rank, so collectives over them line up.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    groups: list[ProcessGroup | None] = []
    for group in _fsdp2_groups(model):
        mesh = group.mesh_info.mesh
        groups += [mesh.get_group(dim) for dim in range(mesh.ndim)]
    for module in model.modules():
        if isinstance(module, FSDP):
            groups += [module.process_group, getattr(module, "_inter_node_pg", None)]
        elif isinstance(module, DDP):
            groups.append(module.process_group)
    unique: list[ProcessGroup] = []
    for group in groups:
        if group is not None and all(group is not g for g in unique):
            unique.append(group)
    return unique


def _param_groups(module: FSDPModule) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.11 (CI's floor) and older: at most one group per module
        group = state._fsdp_param_group
        groups = [group] if group is not None else []
    return list(groups)


def _fsdp2_groups(model: nn.Module) -> list[Any]:
    return [g for m in fsdp2_modules(model) for g in _param_groups(m)]


@contextlib.contextmanager
def _fsdp2_no_sync(modules: list[FSDPModule]) -> Iterator[None]:
    groups = [g for m in modules for g in _param_groups(m)]
    saved = [(g, g.reduce_grads, getattr(g, "all_reduce_grads", None)) for g in groups]
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        # Restore each group's own flags rather than forcing True: the caller
        # may have disabled sync itself around a larger scope.
        for group, reduce_grads, all_reduce_grads in saved:
            group.reduce_grads = reduce_grads
            if all_reduce_grads is not None:
                group.all_reduce_grads = all_reduce_grads


@contextlib.contextmanager
def _fsdp1_no_sync(roots: list[FSDP]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for root in roots:
            stack.enter_context(root.no_sync())
        yield


def no_sync_context(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """A context in which ``model``'s backward passes do not synchronise gradients.

    FSDP2 modules get ``set_requires_gradient_sync(False)`` with their previous
    flags restored on exit (also when the body raises); FSDP1, DDP and any
    wrapper with a ``no_sync()`` context manager (Megatron-Core's DDP) use it;
    a plain module gets a no-op.
    """
    modules = fsdp2_modules(model)
    if modules:
        return _fsdp2_no_sync(modules)
    no_sync = getattr(model, "no_sync", None)
    if callable(no_sync):
        context: contextlib.AbstractContextManager[None] = no_sync()
        return context
    roots = fsdp1_roots(model)
    if roots:
        return _fsdp1_no_sync(roots)
    return contextlib.nullcontext()


def _unique_bytes(tensors: list[torch.Tensor | None]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _fsdp2_held_grads(fsdp_param: Any) -> list[torch.Tensor | None]:
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    held = [unsharded.grad if unsharded is not None else None]
    # Older torch accumulates in a separate reduce-dtype tensor; newer torch
    # keeps a property that aliases the unsharded .grad (deduplicated by id).
    held.append(getattr(fsdp_param, "unsharded_accumulated_grad", None))
    return held


def _fsdp1_handles(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    handles: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDP):
            handle = getattr(module, "_handle", None)
            if handle is not None:
                handles.append(handle)
    return handles


def _fsdp1_unsharded_grad(handle: Any) -> torch.Tensor | None:
    if not handle.uses_sharded_strategy:
        return None  # NO_SHARD (also FSDP1's choice at world size 1): grads are never sharded
    grad: torch.Tensor | None = handle.flat_param.grad
    if grad is not None and grad.size() == handle.flat_param._unpadded_unsharded_size:
        return grad
    return None


def measure_retained_bytes(model: nn.Module) -> int:
    """Bytes of unsharded gradient that ``model`` holds right now because sync was off."""
    groups = _fsdp2_groups(model)
    if groups:
        return _unique_bytes(
            [t for g in groups for p in g.fsdp_params for t in _fsdp2_held_grads(p)]
        )
    handles = _fsdp1_handles(model)
    if handles:
        return _unique_bytes([_fsdp1_unsharded_grad(h) for h in handles])
    return 0  # DDP and plain modules: deferral keeps the same .grad tensors


def _fsdp2_held_dtype(fsdp_param: Any) -> torch.dtype:
    """The dtype of the unsharded gradient FSDP2 keeps while sync is off.

    Derived from the parameter's ``MixedPrecisionPolicy`` and original dtype,
    which exist from ``fully_shard`` on (FSDP2 only resolves its own dtype
    attributes lazily, at the first forward), with the same clamping rules.
    """
    policy = fsdp_param.mp_policy
    orig: torch.dtype = fsdp_param.sharded_param.dtype
    param_dtype: torch.dtype | None = policy.param_dtype
    if param_dtype == orig or not orig.is_floating_point:
        param_dtype = None
    compute = param_dtype or orig
    if hasattr(type(fsdp_param), "unsharded_grad_dtype"):
        # Newer torch: autograd accumulates straight into the unsharded .grad,
        # upcast to the reduce dtype (else the original dtype) when that is
        # wider than the compute dtype.
        grad_dtype: torch.dtype = policy.reduce_dtype or orig
        if getattr(fsdp_param, "_has_sharded_grad_dtype_override", False):
            grad_dtype = policy.reduce_dtype or fsdp_param.sharded_grad_dtype
        if grad_dtype.is_floating_point and grad_dtype.itemsize > compute.itemsize:
            return grad_dtype
        return compute
    # Older torch: `to_accumulated_grad_if_needed` casts into reduce_dtype,
    # which FSDP clamps to None when it equals param_dtype.
    reduce_dtype: torch.dtype | None = policy.reduce_dtype
    if reduce_dtype == policy.param_dtype:
        reduce_dtype = None
    return reduce_dtype or compute


def _fsdp2_full_numel(fsdp_param: Any) -> int:
    # The sharded parameter is a DTensor whose numel() is the global (unsharded) size.
    numel: int = fsdp_param.sharded_param.numel()
    return numel


def predict_deferred_bytes(model: nn.Module) -> int:
    """Bytes :func:`measure_retained_bytes` will report between deferred micro-batches.

    Counts every trainable parameter; it equals the measurement once every such
    parameter has received a gradient.
    """
    groups = _fsdp2_groups(model)
    if groups:
        total = 0
        for group in groups:
            for p in group.fsdp_params:
                if p.sharded_param.requires_grad:
                    total += _fsdp2_full_numel(p) * _fsdp2_held_dtype(p).itemsize
        return total
    handles = _fsdp1_handles(model)
    if handles:
        total = 0
        for handle in handles:
            flat = handle.flat_param
            if handle.uses_sharded_strategy and flat.requires_grad:
                # Under no_sync FSDP1 keeps the unpadded unsharded gradient in
                # the forward/backward (mixed-precision) parameter dtype.
                numel = flat._unpadded_unsharded_size.numel()
                total += numel * handle._fwd_bwd_param_dtype.itemsize
        return total
    return 0
