"""Weight layouts for the benchmark: a real model's state-dict names, shapes and dtypes.

``qwen2.5-0.5b`` is Qwen2.5-0.5B's state dict as a trainer sends it (the tied
``lm_head`` once, as ``model.embed_tokens.weight``): 24 decoder layers,
hidden 896, MLP 4864, 14 query and 2 key/value heads of 64, vocabulary 151936,
bf16; 290 tensors from 896 elements to 136M. :func:`scaled` keeps those
shapes and changes the number of decoder layers (and, below 1 GiB, the
vocabulary) to reach a size, so a size sweep keeps one model's mix of
tensor sizes. Nothing is downloaded: only shapes are described.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Layout", "lora_layout", "qwen2_layout", "scaled", "shapes_by_name"]

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


@dataclasses.dataclass(frozen=True, slots=True)
class _Qwen2:
    vocab: int = 151936
    hidden: int = 896
    intermediate: int = 4864
    heads: int = 14
    kv_heads: int = 2
    layers: int = 24

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def qwen2_layout(spec: _Qwen2 = _Qwen2(), dtype: torch.dtype = torch.bfloat16) -> Layout:
    """The state dict of a Qwen2 decoder with tied embeddings, in the order HF lists it."""
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    layout: Layout = [("model.embed_tokens.weight", (spec.vocab, h), dtype)]
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        layout += [
            (p + "self_attn.q_proj.weight", (h, h), dtype),
            (p + "self_attn.q_proj.bias", (h,), dtype),
            (p + "self_attn.k_proj.weight", (kv, h), dtype),
            (p + "self_attn.k_proj.bias", (kv,), dtype),
            (p + "self_attn.v_proj.weight", (kv, h), dtype),
            (p + "self_attn.v_proj.bias", (kv,), dtype),
            (p + "self_attn.o_proj.weight", (h, h), dtype),
            (p + "mlp.gate_proj.weight", (spec.intermediate, h), dtype),
            (p + "mlp.up_proj.weight", (spec.intermediate, h), dtype),
            (p + "mlp.down_proj.weight", (h, spec.intermediate), dtype),
            (p + "input_layernorm.weight", (h,), dtype),
            (p + "post_attention_layernorm.weight", (h,), dtype),
        ]
    layout.append(("model.norm.weight", (h,), dtype))
    return layout


def nbytes(layout: Layout) -> int:
    total = 0
    for _, shape, dtype in layout:
        n = 1
        for s in shape:
            n *= s
        total += n * dtype.itemsize
    return total


def scaled(gib: float) -> Layout:
    """Qwen2.5-0.5B's shapes with as many decoder layers as make about ``gib`` GiB (within
    one layer, 29.8 MB); below 1 GiB the vocabulary shrinks so the embedding is a quarter."""
    target = gib * (1 << 30)
    base = _Qwen2()
    vocab = base.vocab if gib >= 1 else max(1, int(target / 4 / (base.hidden * 2)))
    no_layers = _Qwen2(vocab=vocab, layers=0)
    one_layer = nbytes(qwen2_layout(_Qwen2(vocab=vocab, layers=1))) - nbytes(
        qwen2_layout(no_layers)
    )
    layers = max(1, round((target - nbytes(qwen2_layout(no_layers))) / one_layer))
    return qwen2_layout(_Qwen2(vocab=vocab, layers=layers))


def shapes_by_name(name: str) -> Layout:
    """A named layout (``qwen2.5-0.5b``)."""
    if name == "qwen2.5-0.5b":
        return qwen2_layout()
    raise ValueError(f"shapes: {name!r} is not known; use 'qwen2.5-0.5b'")


def lora_layout(layout: Layout, rank: int, dtype: torch.dtype = torch.float32) -> Layout:
    """The LoRA adapter of rank ``rank`` on every linear layer of ``layout``'s decoder
    layers (PEFT's ``all-linear``: the embedding and output layer excluded) under the names
    of PEFT's saved adapter, in ``dtype`` (PEFT keeps adapters of a bf16 model in float32
    unless told otherwise): ``lora_A`` is ``(rank, in)``, ``lora_B`` ``(out, rank)``."""
    adapter: Layout = []
    for name, shape, _ in layout:
        if ".layers." in name and name.endswith("proj.weight") and len(shape) == 2:
            module = "base_model.model." + name.removesuffix(".weight")
            out_features, in_features = shape
            adapter += [
                (module + ".lora_A.weight", (rank, in_features), dtype),
                (module + ".lora_B.weight", (out_features, rank), dtype),
            ]
    return adapter
