"""Which of vLLM's modules a checkpoint tensor is written into, and the modules that must be
processed again after a load (a tied head). Imports torch only: vLLM's model is passed in."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

__all__ = ["layer_of", "quiet_layerwise", "refresh_tied"]


def layer_of(model: torch.nn.Module, name: str) -> str | None:
    """The module of ``model`` that the checkpoint tensor ``name`` is loaded into: its
    parent module's path, a fused projection's for its parts (``q_proj`` into
    ``qkv_proj``, from the model's ``packed_modules_mapping``); None if not found."""
    path = name.rpartition(".")[0]
    parent, _, leaf = path.rpartition(".")
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        if leaf in parts:
            path = f"{parent}.{fused}" if parent else fused
            break
    try:
        model.get_submodule(path)
    except AttributeError:
        return None
    return path


@contextlib.contextmanager
def quiet_layerwise(partial: bool) -> Iterator[None]:
    """A partial reload leaves most layers unloaded on purpose; vLLM's layerwise reload
    warns "Failed to load weights" for each: not said for a partial one."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = log.level
    if partial:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def refresh_tied(model: torch.nn.Module) -> list[str]:
    """Process again the modules that share a parameter with another (a tied ``lm_head``
    holds ``embed_tokens``' weight); their names.

    vLLM's layerwise reload processes a shared parameter once, through the module whose
    weights the update names (``model.embed_tokens.weight``: a tied model's checkpoint has
    no ``lm_head.weight``, and vLLM skips it), and writes the result into the shared
    storage; a module that holds the same parameter without loading it keeps what its own
    processing made of the old weights. On CPU that is the packed copy (oneDNN or the SGL
    kernel) its GEMM reads, so the logits came from the old weights after every update.
    Only unquantized methods are run again (processing there only re-packs for the GEMM;
    a quantized one is not idempotent), so a tied quantized head stays as vLLM leaves it."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append((name, module))
    done: list[str] = []
    for sharing in owners.values():
        if len(sharing) < 2:
            continue
        for name, module in sharing:
            method = getattr(module, "quant_method", None)
            if method is not None and type(method).__name__.startswith("Unquantized"):
                method.process_weights_after_loading(module)
                done.append(name)
    return done
