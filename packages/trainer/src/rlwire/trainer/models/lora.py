"""LoRA through PEFT: the ``actor.lora`` section, wrapping a policy, and the names, merges and
files that adapter-only weight sync and export need.

A weight sync under LoRA moves the adapter only, under the names of PEFT's saved adapter
(``base_model.model.<module>.lora_A.weight``, the adapter name left out), which is what
``PeftModel.from_pretrained`` and vLLM read; the rollout engines hold the same base weights
from the model directory (an initialisation that rewrites them is refused) and apply the
adapter in place. ``hf_model/`` is the merged model, ``adapter/`` the adapter in PEFT's
format; merging one into the base gives the other exactly (the same ``base + (B @ A) x
scaling`` as PEFT's ``merge_and_unload``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .modeling import write_swapped

if TYPE_CHECKING:
    from peft import PeftMixedModel, PeftModel

__all__ = [
    "LoraSection",
    "adapter_name",
    "adapter_targets",
    "base_name",
    "describe",
    "is_adapter",
    "merge_delta",
    "merged_weights",
    "save_adapter",
    "unwrapped_name",
    "wrap",
]

_ADAPTER = "default"  # PEFT's name for the one adapter
_PEFT_PREFIX = "base_model.model."
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_orig_mod.")  # FSDP1, torch.compile: anywhere


@dataclasses.dataclass(kw_only=True, slots=True)
class LoraSection:
    """``actor.lora``: LoRA adapters trained with PEFT instead of every weight (verl's
    ``actor_rollout_ref.model.lora_rank``, ``lora_alpha``, ``target_modules``)."""

    rank: int = 0
    """The adapters' rank ``r``; 0: full fine-tuning, no adapters."""
    alpha: float = 16.0
    """``lora_alpha``: the adapter's output is scaled by ``alpha / rank``."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt (a list, as PEFT matches them), or ``all-linear`` (every linear
    layer but the output layer)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank >= 0):
            raise ValueError(
                f"actor.lora.rank: {self.rank!r} is not allowed; use an int >= 0 (0: off)"
            )
        if not self.alpha > 0:
            raise ValueError(f"actor.lora.alpha: {self.alpha!r} is not allowed; use a float > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(
                f"actor.lora.dropout: {self.dropout!r} is not allowed; use a float in [0, 1)"
            )
        targets = self.target_modules
        if isinstance(targets, str) and targets != "all-linear":
            self.target_modules = targets = [targets]
        if isinstance(targets, list) and not (targets and all(isinstance(t, str) for t in targets)):
            raise ValueError(
                f"actor.lora.target_modules: {targets!r} is not allowed; use 'all-linear' or "
                "a non-empty list of module names"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_path: str | None = None):
        """PEFT's ``LoraConfig`` for this section (adapters start as the base model: B = 0)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # PEFT says int; scales by alpha / r
            target_modules=self.target_modules,
            lora_dropout=self.dropout,
            bias="none",
            init_lora_weights=True,
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_path,
        )


def wrap(model: torch.nn.Module, section: LoraSection) -> PeftModel | PeftMixedModel:
    """``model`` with LoRA adapters (PEFT's ``get_peft_model``): only their parameters train.

    Raises:
        ValueError: ``target_modules`` names an embedding or the output layer of a model
            whose embeddings are tied (the adapted layer would change both), or matches
            nothing; PEFT added ``modules_to_save`` (whole modules, which adapter-only sync
            would not carry) or would train anything but ``lora_A`` / ``lora_B`` (an
            embedding layer's adapter).
    """
    from peft import get_peft_model

    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and isinstance(section.target_modules, list):
        tied_names = {"lm_head", "embed_tokens"} & set(section.target_modules)
        if tied_names:
            raise ValueError(
                f"actor.lora.target_modules: {sorted(tied_names)} are tied to each other in "
                "this model (tie_word_embeddings); adapt the decoder's linear layers instead"
            )
    try:
        wrapped = get_peft_model(model, section.peft_config())
    except ValueError as error:  # PEFT's "Target modules ... not found in the base model"
        raise ValueError(f"actor.lora.target_modules: {error}") from None
    kept = getattr(wrapped, "modules_to_save", None)
    if kept:  # whole modules trained beside the adapter would never reach the rollout engines
        raise ValueError(f"LoRA with modules_to_save ({sorted(kept)}) is not supported")
    # Everything that trains must be what syncs, checkpoints and export carry: PEFT names an
    # embedding's adapter lora_embedding_A/B, which they do not.
    other = sorted(
        n for n, p in wrapped.named_parameters() if p.requires_grad and not is_adapter(n)
    )
    if other:
        modules = sorted({n.split(".lora_")[0].removeprefix("base_model.model.") for n in other})
        raise ValueError(
            f"actor.lora.target_modules: PEFT would train {modules} with parameters other than "
            "lora_A/lora_B (an embedding's are lora_embedding_A/B), which the weight sync, "
            "checkpoints and export do not carry; adapt linear layers instead"
        )
    return wrapped


def describe(model: torch.nn.Module, section: LoraSection, *, reference: bool) -> list[str]:
    """What a LoRA run logs once at start, from the PEFT ``model`` before it is sharded: the
    trained share, AdamW's state against full fine-tuning, and (with a KL ``reference``) the
    copy of the model that the disabled adapter saves."""
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]  # the base model

    def mib(ps, times: int = 1) -> str:
        return f"{times * sum(p.numel() * p.element_size() for p in ps) / 2**20:.2f} MiB"

    count, base = sum(p.numel() for p in trained), sum(p.numel() for p in frozen)
    lines = [
        f"LoRA rank {section.rank} (alpha {section.alpha:g}): {count:,} adapter parameters "
        f"train ({100 * count / base:.2f}% of the model's {base:,}); AdamW state "
        f"{mib(trained, 2)} (full fine-tuning: {mib(frozen, 2)}); weight syncs carry the "
        "adapter only"
    ]
    if reference:
        lines.append(
            "the KL reference is the model with its adapter disabled: no second copy "
            f"({mib(frozen)} saved)"
        )
    return lines


def unwrapped_name(name: str) -> str:
    """``name`` without what wrappers add: FSDP1's and ``torch.compile``'s segments (at any
    depth), DDP's leading ``module.``."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name.removeprefix("module.")


def is_adapter(name: str) -> bool:
    """Whether a PEFT state-dict ``name`` is an adapter weight (``lora_A`` / ``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_name(name: str) -> str:
    """The name an adapter weight has in PEFT's saved adapter (and on the wire):
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, the adapter's
    name (``default``) and wrapper prefixes left out."""
    return unwrapped_name(name).replace(f".{_ADAPTER}.", ".")


def base_name(name: str) -> str:
    """The Hugging Face name of a PEFT model's base weight (``model.layers.0...weight``)."""
    return unwrapped_name(name).removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def adapter_targets(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """A PEFT model's adapter parameters by their wire names (:func:`adapter_name`)."""
    return {
        adapter_name(name): param for name, param in model.named_parameters() if is_adapter(name)
    }


def merged_weights(
    items: Iterable[tuple[str, torch.Tensor]], scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT model's full state dict as the merged model's ``(Hugging Face name, tensor)``:
    each adapted weight ``W + (B @ A) x scaling`` (PEFT's ``merge_and_unload``, bit for bit),
    everything else as it is. ``items`` come in state-dict order (a module's base weight
    before its adapter)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in items:
        name = unwrapped_name(name)
        if is_adapter(name):
            module, kind = name.split(".lora_")[0], name.split(".lora_")[1][0]
            parts = pending[module]
            parts[kind] = value
            if "A" in parts and "B" in parts:
                base = parts.pop("base")
                yield (
                    base_name(f"{module}.weight"),
                    (base + merge_delta(parts["A"], parts["B"], scaling)).to(base.dtype),
                )
                del pending[module]
        elif ".base_layer.weight" in name:
            pending[name.removesuffix(".base_layer.weight")] = {"base": value}
        else:
            yield base_name(name), value
    if pending:
        raise ValueError(f"adapted weights without both adapter halves: {sorted(pending)[:3]}")


def merge_delta(A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """``(B @ A) x scaling`` as PEFT computes it for a merge (in float32 for half-precision
    adapters on the CPU, then back)."""
    if A.device.type == "cpu" and A.dtype in (torch.float16, torch.bfloat16):
        return ((B.float() @ A.float()) * scaling).to(A.dtype)
    return (B @ A) * scaling


def save_adapter(
    items: Iterable[tuple[str, torch.Tensor]],
    section: LoraSection,
    base_path: str,
    target: Path,
    *,
    extra: Mapping[str, str] | None = None,
    sole_writer: bool = False,
) -> None:
    """Write the adapter (``(wire name, tensor)`` pairs) as PEFT saves one at ``target``:
    ``adapter_config.json`` and ``adapter_model.safetensors``, loadable with
    ``PeftModel.from_pretrained`` and by vLLM. Written beside and swapped in whole, as
    :func:`.modeling.save_hf_model` writes a model (``extra`` and ``sole_writer`` as
    there)."""
    from safetensors.torch import save_file

    def write(staging: Path) -> None:
        tensors = {name: value.detach().to("cpu").contiguous() for name, value in items}
        save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = section.peft_config(base_path).to_dict()
        # the modules adapted, as PEFT writes them once resolved (``all-linear`` included)
        config["target_modules"] = sorted(
            {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors}
        )
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))

    write_swapped(target, write, extra=extra, sole_writer=sole_writer)  # as hf_model/ is
