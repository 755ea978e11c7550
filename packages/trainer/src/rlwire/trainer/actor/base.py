"""The actor-engine seam: what a training rank needs from FSDP, Megatron or a third party.

An :class:`ActorEngine` owns the policy model (wrapped for data parallelism), its
optimizer and, with a KL loss or KL in the reward, the frozen reference policy, on one rank
of the actor group (``torch.distributed`` is initialised before it is built). The
worker (:class:`rlwire.trainer.runtime.workers.ActorWorker`) runs the GRPO loss through
``model``; everything that differs between wrappers is a method here.

Engines are chosen by ``actor.strategy``: a name from :data:`ACTOR_ENGINES` or a dotted
path ``package.module:Class`` to a subclass, imported in every actor process.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from ..models.modeling import load_hf_model
from ..plugins import load_class

__all__ = [
    "ACTOR_ENGINES",
    "ActorEngine",
    "actor_engine_class",
    "bf16_lost_share",
    "cast_for_sync",
    "load_hf_model",
]

# name -> "module:Class", imported on first use (Megatron's import is slow and optional).
ACTOR_ENGINES: dict[str, str] = {
    "fsdp2": "rlwire.trainer.actor.fsdp:FSDP2Engine",
    "fsdp": "rlwire.trainer.actor.fsdp:FSDP1Engine",
    "megatron": "rlwire.trainer.actor.megatron:MegatronEngine",
}


class ActorEngine(abc.ABC):
    """One data-parallel rank's policy, optimizer and reference policy.

    Args:
        config: the whole :class:`rlwire.trainer.config.root.TrainerConfig`.
        model_path: a Hugging Face model directory.
        device: this rank's device (the group is already initialised).

    Attributes:
        model: the wrapped policy, called as ``model(input_ids=..., attention_mask=...)``.
        reference: the frozen reference policy (wrapped alike) or ``None``.
        optimizer: its optimizer (``param_groups`` with ``lr``: :meth:`scale_lr`).
    """

    name: ClassVar[str] = ""
    supports_lora: ClassVar[bool] = False
    """Whether the engine trains ``actor.lora`` adapters (then :meth:`named_sync_weights`
    yields the adapter only, under PEFT's saved names:
    :func:`rlwire.trainer.models.lora.adapter_name`)."""

    def __init__(self, config, model_path: str, device: torch.device) -> None:
        if config.actor.lora.enabled and not self.supports_lora:
            raise ValueError(
                f"actor.lora.rank: {config.actor.lora.rank} is not allowed with "
                f"actor.strategy={config.actor.strategy!r}: {type(self).__name__} does not "
                "train LoRA adapters; use fsdp2 or fsdp, or rank 0"
            )
        self.config = config
        self.model_path = model_path
        self.device = device
        self.model: torch.nn.Module
        self.optimizer: Any  # torch's, or Megatron's (param_groups, but not a torch Optimizer)
        self.reference: torch.nn.Module | None = None

    # --- training ---------------------------------------------------------------------
    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Reduce what backward accumulated, clip to ``actor.optim.grad_clip``, step, zero
        the gradients; return the norm of the whole (all-rank) gradient before clipping."""

    def scale_lr(self, factor: float) -> None:
        """Set every parameter group's learning rate to ``actor.optim.lr x factor`` for the
        steps that follow (the staleness-aware step size); engines whose optimizer has no
        ``param_groups`` override it."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.actor.optim.lr * factor

    def lr_in_effect(self) -> float:
        """The learning rate the optimizer's next step uses (its first parameter group's),
        read back from the optimizer: what the metrics report."""
        return float(self.optimizer.param_groups[0]["lr"])

    @contextlib.contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module | None]:
        """The frozen reference policy for the block (``reference``, or None without one);
        with LoRA, the model itself with its adapters disabled."""
        yield self.reference

    # --- weights to the rollout engines ----------------------------------------------
    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(Hugging Face name, full tensor)`` for every parameter and buffer of the policy
        (with LoRA, merged). A collective: every rank of the group iterates it to the end
        (gathers run inside)."""

    def named_sync_weights(
        self, *, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends: :meth:`named_weights`, or with LoRA the adapter only.
        A collective, like it.

        Args:
            dtype: the rollout engine's parameter dtype. Each tensor held in the actor's
                own parameter dtype (:attr:`param_dtype`) is cast to it on its device, one at a
                time as it is gathered, before it leaves: an fp32 actor hands a bf16 engine
                bf16, half the bytes to move, with no fp32 copy beyond the tensor in hand.
                Tensors in another dtype (integer buffers, modules kept in fp32) go as they
                are, as the engine holds them. None: every tensor as the actor holds it.
        """
        return cast_for_sync(self.named_weights(), self.param_dtype, dtype)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the policy's parameters are held in (the master weights:
        ``TrainerConfig.held_dtype``)."""
        return getattr(torch, self.config.held_dtype())

    def local_shards(
        self, *, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor, int]] | None:
        """``(name, this rank's part, flat offset of its first element in the whole
        tensor)`` for every tensor :meth:`named_sync_weights` yields, in its order, in the
        dtype it sends (``dtype`` as there) and without any communication (the part may be
        empty); None when this engine cannot say (a sync then compares whole tensors:
        ``ckpt_engine.delta_sharded``)."""
        return None

    # --- between phases -----------------------------------------------------------------
    @abc.abstractmethod
    def offload(
        self, *, model: bool = True, optimizer: bool = True, reference: bool = True
    ) -> None:
        """Move the model, optimizer state and reference to the host (``actor.offload``).
        ``model=False`` keeps what :meth:`named_sync_weights` reads on the device (for a
        sync that follows: it then sends without reloading them, and a later call moves
        them); parts already on the host stay there, so calling it again is safe."""

    @abc.abstractmethod
    def reload(self, *, optimizer: bool = True, reference: bool = True) -> None:
        """Bring back what :meth:`offload` moved (optionally without optimizer/reference)."""

    # --- checkpoints -------------------------------------------------------------------
    @abc.abstractmethod
    def state(self) -> dict[str, Any]:
        """The model and optimizer state for :mod:`torch.distributed.checkpoint` (a
        collective: every rank calls it): keyed so that it does not depend on the world
        size (``DTensor`` shards, or full tensors that every rank holds alike), so a
        checkpoint resumes at any world size. Before the first step it still has the
        optimizer state's layout (``load_state`` fills it)."""

    @abc.abstractmethod
    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned, once DCP has read the checkpoint into it."""

    # --- for the log -----------------------------------------------------------------
    def describe(self) -> dict[str, list[str]]:
        """What the driver logs once at start: ``{"info": [...], "warnings": [...]}``."""
        return {"info": [], "warnings": []}


def bf16_lost_share(params: Iterable[torch.Tensor], lr: float) -> float:
    """The share of the elements of bf16 ``params`` (this rank's shards) that an update of
    size ``lr`` (AdamW's step is about the learning rate) cannot change: those where it is
    under half a bf16 step (``2**(e - 8)`` for a value in ``[2**e, 2**(e + 1))``, 7 stored
    mantissa bits), so that rounding takes the weight back."""
    lost = total = 0
    for param in params:
        local = param.to_local() if hasattr(param, "to_local") else param
        values = local.detach().float()
        _, exponent = torch.frexp(values)  # values = m * 2**exponent, 0.5 <= |m| < 1
        half_step = torch.ldexp(torch.ones_like(values), exponent - 9)
        lost += int(((values != 0) & (half_step > lr)).sum())
        total += values.numel()
    return lost / total if total else 0.0


def cast_for_sync(
    items: Iterator[tuple[str, torch.Tensor]], held: torch.dtype, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` with each tensor in ``held`` cast to ``dtype`` on its own device, lazily (one
    tensor at a time); unchanged when ``dtype`` is None or ``held``."""
    if dtype is None or dtype == held:
        return items
    return ((name, value.to(dtype) if value.dtype == held else value) for name, value in items)


def actor_engine_class(strategy: str) -> type[ActorEngine]:
    """The engine class for ``actor.strategy``: a name from :data:`ACTOR_ENGINES` or a
    dotted path ``package.module:Class`` (see :func:`rlwire.trainer.plugins.load_class`)."""
    return load_class("actor.strategy", strategy, ACTOR_ENGINES, ActorEngine)
