"""The Megatron actor engine (``actor.strategy=megatron``): the Hugging Face policy wrapped in
Megatron-Core's ``DistributedDataParallel`` (bucketed gradient buffers), stepped by
Megatron-Core's optimizer, data parallel over ``actor.world_size`` ranks.

The DDP gradient dtype is not Megatron's default: :func:`rlwire.megatron_ddp.build_ddp_config`
resolves it from the optimizer's precision (fp32 unless the optimizer is precision-aware
with low-precision main grads), explicit ``actor.megatron.override_ddp_config`` keys win,
and :func:`rlwire.megatron_ddp.check_consistency` warnings are logged once at start-up.

Tensor and pipeline parallelism are out of scope: the model stays a Hugging Face module
(Megatron's DDP and optimizer work on any module; TP/PP need Megatron's own model code).

CPU: Megatron-Core assumes CUDA in three ways that its DDP wrapper and optimizer hit:
buffers allocated on ``torch.cuda.current_device()``, factory calls with a literal
``device="cuda"`` (loss scale, grad-norm accumulators) and dtype checks by type string
(``param.type() == "torch.cuda.FloatTensor"``). :func:`cpu_shim` answers those three for
the CPU, and is entered only around Megatron's construction, ``optimizer.step()`` and
state loading, never around forward/backward; on CUDA it does nothing. Everything the
engine uses then runs on gloo (``reduce_scatter_tensor`` and ``all_gather_into_tensor``
included, so the distributed optimizer works too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from ..models.modeling import load_hf_model, set_gradient_checkpointing
from .base import ActorEngine
from .megatron_state import full_optimizer_state, load_full_optimizer_state

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MegatronActor", "MegatronEngine", "cpu_shim", "megatron_configs", "optimizer_settings"]

log = logging.getLogger("rlwire.trainer")

INSTALL_HINT = (
    "actor.strategy=megatron needs megatron-core and rlwire-megatron-ddp: "
    "pip install 'rlwire-trainer[megatron]'"
)


class _CudaAsCpu(TorchFunctionMode):
    """Literal ``device="cuda"`` factories go to the CPU; a CPU tensor's ``.type()`` answers
    with its ``torch.cuda.*`` name (Megatron classifies parameters by that string)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        out = func(*args, **kwargs)
        is_type_name = func is torch.Tensor.type and len(args) == 1 and not kwargs
        if is_type_name and isinstance(out, str) and not out.startswith("torch.cuda."):
            out = "torch.cuda." + out.removeprefix("torch.")
        return out


@contextlib.contextmanager
def cpu_shim(device: torch.device) -> Iterator[None]:
    """Megatron-Core on the CPU (see the module docstring); a no-op on other devices."""
    if device.type != "cpu":
        yield
        return
    with (
        mock.patch("torch.cuda.current_device", lambda: torch.device("cpu")),
        _CudaAsCpu(),
    ):
        yield


def optimizer_settings(config, *, params_dtype: torch.dtype) -> dict[str, Any]:
    """The Megatron ``OptimizerConfig`` fields for ``config`` (``actor.optim`` first, then
    ``actor.megatron.optimizer``, then ``override_optimizer_config``); dtypes parsed."""
    try:
        from rlwire.megatron_ddp import parse_dtype
    except ImportError as err:
        raise RuntimeError(f"{INSTALL_HINT} ({err})") from None
    actor = config.actor
    section = actor.megatron
    user = {**section.optimizer, **section.override_optimizer_config}
    for key, value in user.items():
        if key.endswith("_dtype") and isinstance(value, str):
            user[key] = parse_dtype(value, field=f"actor.megatron.optimizer.{key}")
    return {
        "optimizer": "adam",
        "lr": actor.optim.lr,
        "weight_decay": actor.optim.weight_decay,
        "clip_grad": actor.optim.grad_clip,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "bf16": params_dtype == torch.bfloat16,
        "params_dtype": params_dtype,
        "use_distributed_optimizer": section.use_distributed_optimizer,
        **user,
    }


def megatron_configs(config, *, params_dtype: torch.dtype):
    """``(optimizer settings, DistributedDataParallelConfig, warnings)`` for ``config``: the
    DDP config resolved by ``rlwire.megatron_ddp`` from the optimizer's precision."""
    try:
        from rlwire.megatron_ddp import build_ddp_config, check_consistency
    except ImportError as err:
        raise RuntimeError(f"{INSTALL_HINT} ({err})") from None
    settings = optimizer_settings(config, params_dtype=params_dtype)
    ddp = build_ddp_config(
        settings,
        config.actor.megatron.override_ddp_config,
        use_distributed_optimizer=settings["use_distributed_optimizer"],
    )
    return settings, ddp, check_consistency(ddp, settings)


def _optimizer_config(settings: dict[str, Any]):
    from megatron.core.optimizer import OptimizerConfig

    known = {f.name for f in dataclasses.fields(OptimizerConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(
            f"actor.megatron.optimizer / override_optimizer_config: unknown OptimizerConfig "
            f"field(s) {unknown}; valid: {', '.join(sorted(known))}"
        )
    try:
        return OptimizerConfig(**settings)
    except (AssertionError, TypeError, ValueError, ImportError) as err:
        hint = ""
        if settings.get("use_precision_aware_optimizer"):
            hint = " (the precision-aware optimizer needs Transformer Engine's FusedAdam: CUDA)"
        raise ValueError(
            f"actor.megatron: Megatron-Core rejects this optimizer configuration{hint}: "
            f"{type(err).__name__}: {err}"
        ) from None


class MegatronActor:
    """The model under Megatron DDP and its Megatron optimizer, on one data-parallel rank."""

    def __init__(
        self, config, model: PreTrainedModel, device: torch.device, *, optimizer: bool = True
    ) -> None:
        """Wrap ``model`` in Megatron DDP, then (unless ``optimizer=False``: the DDP
        wrapper alone, for inspecting its buffers) build Megatron's optimizer."""
        try:
            from megatron.core import parallel_state
            from megatron.core.distributed import DistributedDataParallel
            from megatron.core.optimizer import get_megatron_optimizer
            from megatron.core.transformer import TransformerConfig
        except ImportError as err:
            raise RuntimeError(f"{INSTALL_HINT} ({err})") from None
        self.device = device
        if not parallel_state.model_parallel_is_initialized():
            # data parallel only: TP = PP = 1 over the actor group (the default group)
            parallel_state.initialize_model_parallel(1, 1)
        params_dtype = next(model.parameters()).dtype
        self.settings, self.ddp_config, self.warnings = megatron_configs(
            config, params_dtype=params_dtype
        )
        hf = model.config
        transformer = TransformerConfig(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            params_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
        )
        with cpu_shim(device):
            self.model = DistributedDataParallel(transformer, self.ddp_config, model)
        self.optimizer = None
        if optimizer:
            self.optimizer_config = _optimizer_config(self.settings)
            with cpu_shim(device):
                self.optimizer = get_megatron_optimizer(self.optimizer_config, [self.model])

    # --- one optimizer step over the micro-batches already run --------------------------------
    def step(self) -> float:
        """Reduce the accumulated gradients, step, clear the buffers; the grad norm."""
        self.model.finish_grad_sync()
        assert self.optimizer is not None, "MegatronActor(optimizer=False) does not step"
        with cpu_shim(self.device):
            ok, grad_norm, _ = self.optimizer.step()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if not ok:
            raise RuntimeError("Megatron optimizer skipped the step: non-finite gradients")
        return float(grad_norm)

    def grad_buffer_dtypes(self) -> list[torch.dtype]:
        return [buffer.grad_dtype for buffer in self.model.buffers]

    # --- weights and state ---------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under Hugging Face names (after a step every rank holds them all)."""
        return self.model.module.state_dict()

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [c.optimizer for c in chained]

    def state(self) -> dict[str, Any]:
        """The full weights and every parameter's full Adam state under Hugging Face names:
        the same on every data-parallel rank whatever their number (a collective)."""
        return {
            "model": {k: v.detach().clone() for k, v in self.hf_state_dict().items()},
            "optimizer": full_optimizer_state(self.optimizer, self._names()),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.model.module.load_state_dict(state["model"])
        load_full_optimizer_state(self.optimizer, self._names(), state["optimizer"])

    def _names(self) -> dict[torch.nn.Parameter, str]:
        return {p: name for name, p in self.model.module.named_parameters()}

    # --- offload between phases (Megatron's own buffer offload) -------------------------------
    def offload(self) -> None:
        if self.device.type == "cuda" and hasattr(self.model, "offload_grad_buffers"):
            self.model.offload_grad_buffers()

    def reload(self) -> None:
        if self.device.type == "cuda" and hasattr(self.model, "restore_grad_buffers"):
            self.model.restore_grad_buffers()


class MegatronEngine(ActorEngine):
    """``actor.strategy=megatron``: :class:`MegatronActor` behind the actor-engine seam."""

    name = "megatron"

    def __init__(self, config, model_path: str, device: torch.device) -> None:
        super().__init__(config, model_path, device)
        model = load_hf_model(model_path, config.model.dtype, device)
        set_gradient_checkpointing(model, config.model.enable_gradient_checkpointing)
        self.megatron = MegatronActor(config, model, device)
        self.model, self.optimizer = self.megatron.model, self.megatron.optimizer
        if config.algorithm.uses_reference:  # the frozen reference policy: the initial weights
            reference = load_hf_model(model_path, config.model.dtype, device)
            reference.requires_grad_(False)
            self.reference = reference.eval()

    def optimizer_step(self) -> float:
        return self.megatron.step()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in self.megatron.hf_state_dict().items():
            yield name, value.detach()

    def offload(
        self, *, model: bool = True, optimizer: bool = True, reference: bool = True
    ) -> None:
        from rlwire.offload import offload_model, offload_optimizer

        # Parameters are views into Megatron's buffers and never leave the device: ``model``
        # moves nothing a sync reads, so the gradient buffers go either way (Megatron's
        # own offload; again is a no-op).
        self.megatron.offload()
        for inner in self.megatron._inner_optimizers() if optimizer else []:
            offload_optimizer(inner).wait()
        if reference and self.reference is not None:
            offload_model(self.reference).wait()

    def reload(self, *, optimizer: bool = True, reference: bool = True) -> None:
        from rlwire.offload import load_model, load_optimizer

        self.megatron.reload()
        for inner in self.megatron._inner_optimizers() if optimizer else []:
            load_optimizer(inner)
        if reference and self.reference is not None:
            load_model(self.reference)

    def state(self) -> dict[str, Any]:
        return self.megatron.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.megatron.load_state(state)

    def describe(self) -> dict[str, list[str]]:
        ddp = self.megatron.ddp_config
        fields = {f.name: getattr(ddp, f.name) for f in dataclasses.fields(ddp)}
        buffers = [str(d) for d in self.megatron.grad_buffer_dtypes()]
        optimizer = type(self.megatron.optimizer).__name__
        return {
            "info": [
                f"megatron: DDP config {fields}, grad buffers {buffers}, optimizer {optimizer}"
            ],
            "warnings": [f"megatron: {warning}" for warning in self.megatron.warnings],
        }
