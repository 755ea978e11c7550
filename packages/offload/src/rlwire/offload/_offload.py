"""Offload and load models and optimizer state through a pinned pool, and prepare it ahead."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._layout import chunked_layout, host_views
from ._pool import PinnedPool, default_pool
from ._slots import Slot, drop_grads, module_slots, optimizer_slots
from ._transfer import Transfer

__all__ = [
    "load_model",
    "load_optimizer",
    "offload_model",
    "offload_optimizer",
]

_GRAD_MODES = ("drop", "keep")


@dataclasses.dataclass(slots=True)
class _Offloaded:
    blocks: list[torch.Tensor]
    pool: PinnedPool
    device: torch.device


# owner (model or optimizer) -> its host buffers while offloaded
_offloaded: weakref.WeakKeyDictionary[Any, _Offloaded] = weakref.WeakKeyDictionary()
_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def _debug() -> bool:
    return os.environ.get("RLWIRE_OFFLOAD_DEBUG", "") not in ("", "0")


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for all offload copies (so they overlap compute)."""
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch: untyped
        return _streams[device]


def _in_blocks(t: torch.Tensor, block_ptrs: set[int]) -> bool:
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in block_ptrs


def _side_stream_copies(
    device: torch.device,
    dests: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    non_blocking: bool,
) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Queue ``dest.copy_(src)`` pairs on the device's copy stream, after the current
    stream's work; return the timing events recorded around them."""
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: untyped
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: untyped
    with torch.cuda.stream(stream), torch.no_grad():
        start.record(stream)
        for dst, src in zip(dests, sources, strict=True):
            dst.copy_(src, non_blocking=non_blocking)
        end.record(stream)
    return start, end


def _check_one_device(tensors: Sequence[torch.Tensor], what: str) -> None:
    devices = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
    if len(devices) > 1:
        raise ValueError(
            f"{what}: tensors on {', '.join(devices)}; one device per model or optimizer is "
            "supported (offload each device's part separately)"
        )


def _check_empty_cache(empty_cache: object) -> None:
    if not isinstance(empty_cache, bool):
        raise ValueError(f"empty_cache: {empty_cache!r} is not allowed; use True or False")


def _finish(transfer: Transfer) -> Transfer:
    return transfer.wait() if _debug() else transfer


def _offload(
    owner: Any,
    slots: list[Slot],
    *,
    pool: PinnedPool | None,
    non_blocking: bool,
    what: str,
    include_host: bool,
    empty_cache: bool,
) -> Transfer:
    if owner in _offloaded:
        return Transfer.completed(f"{what} (already offloaded)")
    moving = [s for s in slots if include_host or s.tensor.device.type != "cpu"]
    if not moving:
        return Transfer.completed(f"{what} (nothing on an accelerator)")
    pool = pool or default_pool()
    sources = [s.tensor.detach() for s in moving]
    device = sources[0].device
    chunks = chunked_layout(sources, pool.chunk_bytes)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    hosts: list[torch.Tensor] = [sources[0]] * len(sources)  # each replaced by its host view
    blocks: list[torch.Tensor] = []
    if device.type != "cuda":
        began = time.perf_counter()
        try:
            with torch.no_grad():
                for chunk in chunks:
                    blocks.append(pool.reserve(chunk.nbytes))
                    for i, host in zip(
                        chunk.indices, host_views(blocks[-1], sources, chunk), strict=True
                    ):
                        host.copy_(sources[i])
                        hosts[i] = host
        except BaseException:
            for block in blocks:
                pool.free(block)
            raise
        _offloaded[owner] = _Offloaded(blocks, pool, device)
        for slot, host in zip(moving, hosts, strict=True):
            slot.install(host)
        return Transfer.completed(what, nbytes, time.perf_counter() - began)
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: untyped
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: untyped
    with torch.cuda.stream(stream), torch.no_grad():
        start.record(stream)
        try:
            for chunk in chunks:
                # A buffer the pool lacks is page-locked here, on the host, while the
                # device copies into the buffers before it.
                blocks.append(pool.reserve(chunk.nbytes))
                for i, host in zip(
                    chunk.indices, host_views(blocks[-1], sources, chunk), strict=True
                ):
                    host.copy_(sources[i], non_blocking=non_blocking)
                    # The model lets go of the device memory below, before the copy ran:
                    # recording the stream keeps the allocator from reusing it until the
                    # copy is done, so the memory is free for the caller's next
                    # allocations at once.
                    sources[i].record_stream(stream)
                    hosts[i] = host
        except BaseException:  # nothing installed yet: the model is as it was
            failed = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: untyped
            failed.record(stream)
            for block in blocks:  # fenced: copies into them may be queued
                pool.free(block, after=failed)
            raise
        end.record(stream)
    _offloaded[owner] = _Offloaded(blocks, pool, device)
    for slot, host in zip(moving, hosts, strict=True):
        slot.install(host)
    on_done = None
    if empty_cache:

        def on_done() -> None:  # the copies are done: their source blocks are free now
            with torch.cuda.device(device):
                torch.cuda.empty_cache()

    return _finish(Transfer(nbytes, what=what, start=start, end=end, on_done=on_done))


def _load(
    owner: Any,
    slots: list[Slot],
    device: torch.device | str | None,
    *,
    non_blocking: bool,
    what: str,
) -> Transfer:
    record = _offloaded.pop(owner, None)
    if record is None:
        return Transfer.completed(f"{what} (not offloaded)")
    target = torch.device(device) if device is not None else record.device
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    block_ptrs = {block.untyped_storage().data_ptr() for block in record.blocks}
    moving = [s for s in slots if _in_blocks(s.tensor, block_ptrs)]
    sources = [s.tensor.detach() for s in moving]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    if target.type != "cuda":
        began = time.perf_counter()
        for slot, src in zip(moving, sources, strict=True):
            slot.install(src.to(target, copy=True))
        for block in record.blocks:
            record.pool.free(block)
        return Transfer.completed(what, nbytes, time.perf_counter() - began)
    dests = [torch.empty(t.shape, dtype=t.dtype, device=target) for t in sources]
    start, end = _side_stream_copies(target, dests, sources, non_blocking)
    # Work queued on the current stream from now on sees the loaded values.
    torch.cuda.current_stream(target).wait_event(end)
    for slot, dst in zip(moving, dests, strict=True):
        slot.install(dst)
    # Back to the pool now, fenced: the next reservation of these buffers waits for
    # the copy, so a caller who never waits on this load loses no pinned memory.
    for block in record.blocks:
        record.pool.free(block, after=end)
    return _finish(Transfer(nbytes, what=what, start=start, end=end))


def offload_model(
    model: nn.Module,
    *,
    non_blocking: bool = True,
    grads: str = "drop",
    pool: PinnedPool | None = None,
    empty_cache: bool = True,
    _include_host: bool = False,
) -> Transfer:
    """Move every parameter and buffer of ``model`` from the accelerator to pinned host memory.

    Handles plain modules, FSDP2 (the local shard of each ``DTensor``) and
    FSDP1 (flat parameters). Parameter and buffer objects keep their identity,
    so optimizers and hooks holding them keep working; only their storage
    moves, into buffers of ``pool`` (default: the process's pool; tensors packed
    in order into buffers of at most ``pool.chunk_bytes``) that the next cycle
    reuses. A buffer the pool lacks is page-locked on the way, while the copies
    into the ones before run; :func:`prepare_model` does that ahead of time.
    Modules using FSDP2's or FSDP1's own CPU offload are skipped with a log line.

    Safety: with ``non_blocking=True`` the copy runs on a side stream and the
    host tensors are NOT safe to read until the returned :class:`Transfer` is
    waited on (``RLWIRE_OFFLOAD_DEBUG=1`` makes every call wait eagerly). While
    offloaded, an FSDP2 ``DTensor`` parameter still reports its accelerator as
    ``device`` (its local shard is on the host): load before using the model.
    Tensors come back contiguous. FSDP2 modules are resharded first; DDP is refused.

    Args:
        grads: ``"drop"`` frees gradients (also on a machine without an
            accelerator); ``"keep"`` moves them with the parameters.
        empty_cache: once the copies have completed (when the returned
            :class:`Transfer` is waited on, or first seen ``done()``), hand the
            device memory they freed back to the driver with
            ``torch.cuda.empty_cache()``, so that another process (a colocated
            inference engine) can allocate it; verl's offload does the same. ``False``
            keeps it in this process's caching allocator: the next load allocates
            faster, but nobody else can use the memory meanwhile. Not done before
            completion: the blocks are still in use by the copies then.
        _include_host: also move tensors that are already in host memory
            (host-to-host copy); used to exercise this path without an accelerator.

    Returns:
        A :class:`Transfer`; a completed one moving 0 bytes when nothing is on
        an accelerator (models stay where they are) or the model is already offloaded.
    """
    if grads not in _GRAD_MODES:
        raise ValueError(f"grads: {grads!r} is not allowed; use one of {_GRAD_MODES}")
    _check_empty_cache(empty_cache)
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        raise ValueError(
            "offload_model: DistributedDataParallel is not supported (moving a parameter "
            "to another device replaces the gradient accumulators DDP's reducer hooks); "
            "use FSDP2 or FSDP1"
        )
    params, grad_slots = module_slots(model, grads=grads == "keep")
    _check_one_device([s.tensor for s in params + grad_slots], "offload_model")  # before any change
    if grads == "drop":
        drop_grads(model)
    return _offload(
        model,
        params + grad_slots,
        pool=pool,
        non_blocking=non_blocking,
        what="offload_model",
        include_host=_include_host,
        empty_cache=empty_cache,
    )


def load_model(
    model: nn.Module, device: torch.device | str | None = None, *, non_blocking: bool = True
) -> Transfer:
    """Move what :func:`offload_model` put on the host back to ``device``.

    ``device`` defaults to where the tensors came from. The current stream is
    made to wait for the copy, so using the model on it right away is safe;
    the host buffers go back to their pool at once, fenced by the copy's event
    (their next reservation waits for the copy), so waiting is optional.
    """
    params, grad_slots = module_slots(model, grads=True)
    return _load(model, params + grad_slots, device, non_blocking=non_blocking, what="load_model")


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    non_blocking: bool = True,
    pool: PinnedPool | None = None,
    empty_cache: bool = True,
    _include_host: bool = False,
) -> Transfer:
    """Move every state tensor of ``optimizer`` (moments etc.) to pinned host memory.

    Same contract as :func:`offload_model` (``empty_cache`` included). Tensors
    already on the host (Adam's ``step`` counters by default) stay where they are.
    """
    _check_empty_cache(empty_cache)
    slots = optimizer_slots(optimizer)
    _check_one_device([s.tensor for s in slots], "offload_optimizer")
    return _offload(
        optimizer,
        slots,
        pool=pool,
        non_blocking=non_blocking,
        what="offload_optimizer",
        include_host=_include_host,
        empty_cache=empty_cache,
    )


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    device: torch.device | str | None = None,
    *,
    non_blocking: bool = True,
) -> Transfer:
    """Move what :func:`offload_optimizer` put on the host back to ``device``."""
    return _load(
        optimizer,
        optimizer_slots(optimizer),
        device,
        non_blocking=non_blocking,
        what="load_optimizer",
    )
