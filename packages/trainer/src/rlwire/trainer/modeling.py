"""Loading the Hugging Face policy: shared by actor and rollout engines."""

from __future__ import annotations

import torch

__all__ = ["load_hf_model"]


def load_hf_model(path: str, dtype: str, device: torch.device) -> torch.nn.Module:
    """A Hugging Face causal LM from ``path`` in ``dtype`` (``"float32"``, ...) on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device)
