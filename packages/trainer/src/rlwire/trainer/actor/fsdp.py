"""FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``) actor engines.

Both shard every decoder layer and the root, train with AdamW, optionally in mixed
precision (bf16 compute, fp32 reduce), and offload through :mod:`rlwire.offload`.
They differ in wrapping and in how the gradient norm is taken: FSDP2's gradients are
``DTensor``s whose norm reduces over the mesh; FSDP1's are local shards that only its
own ``clip_grad_norm_`` reduces over the ranks.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ..algorithms.step import clip_and_step
from ..models import lora
from ..models.modeling import load_hf_model, set_gradient_checkpointing
from .base import ActorEngine, bf16_lost_share, cast_for_sync

__all__ = ["FSDP1Engine", "FSDP2Engine"]


class _FSDPEngine(ActorEngine):
    """What FSDP2 and FSDP1 share: build, AdamW, reference, weights, offload, state; LoRA
    (``actor.lora``: PEFT adapters inside the sharded model, only they train, have optimizer
    state, are checkpointed and synced; the reference policy is the model with its adapters
    disabled)."""

    supports_lora = True

    def __init__(self, config, model_path: str, device: torch.device) -> None:
        super().__init__(config, model_path, device)
        hf_model = load_hf_model(model_path, config.held_dtype(), device)  # the master weights
        set_gradient_checkpointing(hf_model, config.model.enable_gradient_checkpointing)
        model: torch.nn.Module = hf_model
        self.lora = config.actor.lora if config.actor.lora.enabled else None
        self._info: list[str] = []
        if self.lora is not None:
            model = self._peft = lora.wrap(model, self.lora)
            self._info = lora.describe(model, self.lora, reference=config.algorithm.uses_reference)
        self.model = self._wrap(model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.actor.optim.lr,
            weight_decay=config.actor.optim.weight_decay,
            # torch picks the per-tensor loop on CPUs; the multi-tensor path halves the step
            # on the default job's FSDP2 model (2.98 -> 1.32 ms, DTensor dispatch per op).
            foreach=True,
        )
        if config.algorithm.uses_reference and self.lora is None:  # the initial weights, frozen
            reference = load_hf_model(model_path, config.model.dtype, device)  # computes only
            reference.requires_grad_(False)
            self.reference = self._wrap(reference).eval()
        if config.actor.offload:  # the first offload's page-locking, off its critical path
            from rlwire.offload import prepare_model

            for module in (self.model, self.reference):
                if module is not None:
                    prepare_model(module)  # the offload takes the buffers as they come

    @abc.abstractmethod
    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` sharded over the actor group (the subclass's wrapper)."""

    def optimizer_step(self) -> float:
        return clip_and_step(self.model, self.optimizer, self.config.actor.optim.grad_clip)

    @contextlib.contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module | None]:
        if self.lora is None or not self.config.algorithm.uses_reference:
            with super().reference_policy() as reference:
                yield reference
            return
        with self._peft.disable_adapter():  # the base weights: the initial policy
            yield self.model

    def _full_state(
        self, keep: Callable[[str], bool] = lambda name: True, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of the state dict's entries that ``keep`` accepts, in
        order; FSDP2 gathers each (a collective: every rank iterates to the end). ``dtype``:
        as :meth:`named_sync_weights`; an FSDP2 shard is cast before its gather (the same
        values: rounding is per element), which then moves the narrower bytes."""
        held = self.param_dtype
        for name, value in self.model.state_dict().items():
            if not keep(name):
                continue
            if dtype is not None and value.dtype == held:
                value = value.to(dtype)  # a DTensor stays sharded: each rank casts its shard
            if hasattr(value, "full_tensor"):  # FSDP2: gather the shards (a collective)
                value = value.full_tensor()
            yield name.removeprefix("_fsdp_wrapped_module."), value.detach()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is None:
            return self._full_state()
        return lora.merged_weights(self._full_state(), self.lora.scaling)

    def named_sync_weights(
        self, *, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is not None:
            adapter = self._full_state(lora.is_adapter, dtype)
            return ((lora.adapter_name(n), v) for n, v in adapter)
        if type(self).named_weights is not _FSDPEngine.named_weights:
            # a subclass's named_weights is what syncs send: cast after it
            return cast_for_sync(self.named_weights(), self.param_dtype, dtype)
        return self._full_state(dtype=dtype)

    def offload(
        self, *, model: bool = True, optimizer: bool = True, reference: bool = True
    ) -> None:
        from rlwire.offload import offload_model, offload_optimizer

        if model:
            offload_model(self.model).wait()
        if optimizer:
            offload_optimizer(self.optimizer).wait()
        if reference and self.reference is not None:
            offload_model(self.reference).wait()

    def reload(self, *, optimizer: bool = True, reference: bool = True) -> None:
        from rlwire.offload import load_model, load_optimizer

        load_model(self.model)
        if optimizer:
            load_optimizer(self.optimizer)
        if reference and self.reference is not None:
            load_model(self.reference)

    def state(self) -> dict[str, Any]:
        # One logical layout for FSDP2, FSDP1 and a plain module (canonical parameter names,
        # the optimizer's state keyed by them): what torch.distributed.checkpoint reshards.
        # With LoRA only what trains (the base comes from model.path).
        model, optimizer = get_state_dict(self.model, self.optimizer, options=self._options())
        if self.lora is not None:  # a tied output layer is not a frozen *parameter*: drop it
            model = {name: value for name, value in model.items() if lora.is_adapter(name)}
        return {"model": model, "optimizer": optimizer}

    def load_state(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self._options(),
        )

    def _options(self) -> StateDictOptions:
        lora_only = self.lora is not None  # the frozen base is neither saved nor expected
        return StateDictOptions(ignore_frozen_params=lora_only, strict=not lora_only)

    def describe(self) -> dict[str, list[str]]:
        warnings = []
        if self.param_dtype == torch.bfloat16:
            lr = self.config.actor.optim.lr
            params = [p for p in self.model.parameters() if p.requires_grad]
            lost = bf16_lost_share(params, lr)
            if lost >= 0.25:
                warnings.append(
                    f"actor.master_dtype=bfloat16 at actor.optim.lr={lr:g}: an update of "
                    f"about the learning rate is under half a bfloat16 step for {lost:.0%} of "
                    "the trained weights, which then never change; keep actor.master_dtype="
                    "float32 (float32 master weights, bf16 compute) or raise the learning rate"
                )
        return {"info": self._info, "warnings": warnings}


class FSDP2Engine(_FSDPEngine):
    """``actor.strategy=fsdp2``: ``fully_shard`` on every decoder layer and the root (with
    more than one rank, or mixed precision; one rank in fp32 trains the plain module)."""

    name = "fsdp2"

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.config.actor.world_size == 1 and not self.config.mixed_precision():
            # One rank has nothing to shard or reduce, and torchtitan applies no FSDP at a
            # data-parallel degree of 1: neither do we. Its hooks, copies in and out of its
            # buffers and DTensor dispatch cost the default job's update 12.9 -> 10.0 ms.
            # (Mixed precision keeps the wrapper: its policy is what computes in bf16.)
            return model
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.config.mixed_precision()
            else MixedPrecisionPolicy()
        )
        unwrap = getattr(model, "get_base_model", None)  # PEFT's wrapper (LoRA)
        base: Any = unwrap() if unwrap is not None else model  # the Hugging Face model
        for layer in base.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # in place: its class is now also an FSDPModule
        return model

    def local_shards(
        self, *, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor, int]] | None:
        """Each parameter's and buffer's local shard: FSDP2 splits dim 0 as ``torch.chunk``
        does (rank ``r`` holds rows ``r * ceil(n / world)`` on, maybe none); a tensor that is
        not sharded is rank 0's whole. Not with LoRA (a sync sends adapters)."""
        if self.lora is not None:
            return None
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        shards = _local_shards(self.model.state_dict(), rank, world)
        if dtype is None or dtype == self.param_dtype:
            return shards
        held = self.param_dtype  # float32 master weights, a bf16 engine: what a sync sends
        return ((n, p.to(dtype) if p.dtype == held else p, at) for n, p, at in shards)


def _local_shards(
    state: dict[str, Any], rank: int, world: int
) -> Iterator[tuple[str, torch.Tensor, int]]:
    for name, value in state.items():
        name = name.removeprefix("_fsdp_wrapped_module.")
        if hasattr(value, "to_local"):  # a DTensor, Shard(0) over the actor's ranks
            placements = value.placements
            if len(placements) != 1 or getattr(placements[0], "dim", None) != 0:
                raise RuntimeError(f"{name}: sharded as {placements}, not Shard(0)")
            rows = value.shape[0] if value.dim() else 1
            per_row = value.numel() // rows if rows else 0
            start = min(rank * -(-rows // world), rows)
            yield name, value.to_local().detach(), start * per_row
        elif rank == 0:
            yield name, value.detach(), 0
        else:
            yield name, value.detach().reshape(-1)[:0], 0


class FSDP1Engine(_FSDPEngine):
    """``actor.strategy=fsdp``: ``FullyShardedDataParallel`` with original parameters."""

    name = "fsdp"

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision

        mp = (
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.config.mixed_precision()
            else None
        )
        return FSDP(model, device_id=self.device, mixed_precision=mp, use_orig_params=True)

    def optimizer_step(self) -> float:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # FSDP1's .grad are plain local shards: only its own method reduces over the ranks.
        grad_clip = self.config.actor.optim.grad_clip
        assert isinstance(self.model, FSDP)  # what _wrap made
        grad_norm = self.model.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)
