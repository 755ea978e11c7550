"""Megatron-Core's optimizer state as full per-parameter tensors under Hugging Face names, so
a checkpoint does not depend on the data-parallel size.

The distributed optimizer keeps, on each rank, a contiguous range of every parameter's
fp32 main weights and Adam moments (its range of the flattened gradient buffer); the
ranges depend on the data-parallel size. Here each parameter's ranges are put together
(every rank writes its range into a zero tensor of the parameter's size, and a sum over the
group completes it), and on load each rank takes its own range back out, whatever the size
that saved it. The plain optimizer holds every parameter whole on every rank already. The
model's own weights are saved as they are (every data-parallel rank holds them all).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["full_optimizer_state", "load_full_optimizer_state"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
_KEYS = ("param", *_MOMENTS)


def _optimizers(optimizer) -> list:
    """Megatron's optimizers behind ``optimizer`` (a chained one holds several)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(opt) -> dict[torch.nn.Parameter, torch.Tensor]:
    """The plain optimizer's model parameter -> the main parameter its Adam steps."""
    if hasattr(opt, "float16_groups"):  # bf16/fp16 model parameters with fp32 main copies
        mapping: dict[torch.nn.Parameter, torch.Tensor] = {}
        for model_group, main_group in zip(
            opt.float16_groups, opt.fp32_from_float16_groups, strict=True
        ):
            mapping.update(zip(model_group, main_group, strict=True))
        for group in opt.fp32_from_fp32_groups:
            mapping.update((p, p) for p in group)
        return mapping
    return {p: p for group in opt.optimizer.param_groups for p in group["params"]}


def _local(optimizer, param) -> tuple[torch.optim.Optimizer, torch.Tensor, slice] | None:
    """``(inner optimizer, main parameter, its range of the flattened parameter)`` for what
    this rank holds of ``param``: all of it with the plain optimizer, a range (maybe none)
    with the distributed one."""
    for opt in _optimizers(optimizer):
        if not hasattr(opt, "model_param_gbuf_map"):
            main = _main_params(opt).get(param)
            if main is not None:
                return opt.optimizer, main, slice(0, param.numel())
        elif param in opt.model_param_group_index_map:  # a non-empty range on this rank
            group, order = opt.model_param_group_index_map[param]
            span = opt._get_model_param_range_map(param)["param"]
            main = opt.optimizer.param_groups[group]["params"][order]
            return opt.optimizer, main, slice(span.start, span.end)
    return None


def _distributed(optimizer) -> bool:
    return hasattr(_optimizers(optimizer)[0], "model_param_gbuf_map")


def full_optimizer_state(optimizer, names: dict[torch.nn.Parameter, str]) -> dict[str, Any]:
    """``{"step": tensor, name: {"param", "exp_avg", "exp_avg_sq"}}``: every parameter's fp32
    main weights and moments, whole (zeros before the first step). A collective: the
    parameters go in the model's order on every rank."""
    distributed = _distributed(optimizer)
    full: dict[str, Any] = {}
    steps = []
    for param, name in names.items():
        entry = {k: torch.zeros(param.numel(), dtype=torch.float32) for k in _KEYS}
        local = _local(optimizer, param)
        if local is not None:
            inner, main, span = local
            state = inner.state.get(main, {})
            entry["param"][span] = main.detach().reshape(-1)
            for k in _MOMENTS:
                if k in state:
                    entry[k][span] = state[k].reshape(-1)
            if "step" in state:
                steps.append(float(state["step"]))
        if distributed:
            for value in entry.values():
                dist.all_reduce(value)  # the ranks' ranges partition the parameter
        full[name] = {k: v.view(param.shape) for k, v in entry.items()}
    step = torch.tensor(max(steps, default=0.0), dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a rank may hold no range at all
    full["step"] = step.to(torch.float32)
    return full


def load_full_optimizer_state(
    optimizer, names: dict[torch.nn.Parameter, str], full: dict[str, Any]
) -> None:
    """Put :func:`full_optimizer_state`'s tensors back: each rank its own range."""
    for opt in _optimizers(optimizer):
        if getattr(opt.config, "use_precision_aware_optimizer", False):
            raise RuntimeError(
                "resuming actor.strategy=megatron with actor.megatron.optimizer."
                "use_precision_aware_optimizer=true is not supported yet (Transformer "
                "Engine's FusedAdam keeps its states scaled); resume without it"
            )
    step = full["step"]
    for param, name in names.items():
        local = _local(optimizer, param)
        if local is None:
            continue  # no range of this parameter on this rank
        inner, main, span = local
        piece = {k: v.reshape(-1)[span].view(main.shape) for k, v in full[name].items()}
        with torch.no_grad():
            main.copy_(piece["param"])
        if float(step) > 0:  # before the first step Adam has no state yet
            moments = {k: piece[k].to(main.dtype).clone() for k in _MOMENTS}
            inner.state[main] = {"step": step.clone(), **moments}
