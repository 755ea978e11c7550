"""fp8 weights quantized on the sender, in the layout of vLLM's block-wise fp8 checkpoints.

A rollout engine that runs fp8 weights (vLLM with a checkpoint whose
``quantization_config`` is ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``,
as DeepSeek-V3's and Qwen3's fp8 releases are) loads each linear layer's weight as
``<name>.weight`` (``float8_e4m3fn``) and ``<name>.weight_scale_inv`` (``float32``, one
per 128 x 128 block: ``ceil(out / 128) x ceil(in / 128)``), with ``weight ~= q * scale``
block by block. :func:`fp8_weights` sends exactly that instead of the trainer's bf16
weights: half the bytes of bf16 (plus 1/16384 for the scales), and with ``delta`` on the
sender's mirror compares the quantized bytes, so an update sends only the fp8 values and
scales that changed (a small optimizer step moves few of them across an fp8 step).

The arithmetic is DeepGEMM's ``per_block_cast_to_fp8``, which vLLM uses to quantize
block-wise (``vllm.utils.deep_gemm``): ``scale = max(amax(|block|), 1e-4) / 448`` in
float32, ``q = (block * (1 / scale)).to(float8_e4m3fn)``, so the sender's result is bit
for bit what quantizing the same weights on the receiver gives.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable

import torch

from ._base import Weights
from ._wire import aiter_weights

__all__ = [
    "FP8_BLOCK",
    "dequantize_fp8_blocks",
    "fp8_weights",
    "quantize_fp8_blocks",
    "quantized_by_default",
]

FP8_BLOCK = (128, 128)
"""vLLM's (and DeepSeek-V3's) ``weight_block_size``."""
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_AMAX_FLOOR = 1e-4  # an all-zero block keeps a finite scale
_KEEP = re.compile(r"(^|\.)(embed_tokens|lm_head|embed_in|embed_out|wte|wpe)\.|norm")


def quantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: ``weight`` (2-D, any float dtype) as ``float8_e4m3fn`` with one
    ``float32`` scale per ``block`` (the last blocks may be partial), on its device.

    ``q`` has ``weight``'s shape; ``scale_inv`` is ``ceil(rows / block[0]) x
    ceil(cols / block[1])``; ``weight ~= q.float() * scale_inv`` expanded over each block.
    """
    if weight.dim() != 2:
        raise ValueError(f"fp8 block quantization takes a 2-D weight, not {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    pr, pc = -(-rows // br) * br, -(-cols // bc) * bc
    padded = weight
    if (pr, pc) != (rows, cols):
        padded = weight.new_zeros(pr, pc)
        padded[:rows, :cols] = weight
    blocks = padded.view(pr // br, br, pc // bc, bc)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=_AMAX_FLOOR)
    scale = amax / FP8_MAX
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    q = q.view(pr, pc)[:rows, :cols].contiguous()
    return q, scale.view(pr // br, pc // bc)


def quantized_by_default(name: str, tensor: torch.Tensor) -> bool:
    """A linear layer's weight: 2-D, a floating dtype, named ``*.weight``, and not an
    embedding, the output head or a norm (which fp8 checkpoints keep in their dtype)."""
    return (
        name.endswith(".weight")
        and tensor.dim() == 2
        and tensor.is_floating_point()
        and not _KEEP.search(name)
    )


async def fp8_weights(
    weights: Weights,
    *,
    block: tuple[int, int] = FP8_BLOCK,
    quantize: Callable[[str, torch.Tensor], bool] = quantized_by_default,
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """``weights`` as an fp8 checkpoint holds them: each tensor ``quantize`` picks becomes
    ``name`` (``float8_e4m3fn``) and ``name + "_scale_inv"`` (``float32`` block scales,
    ``<layer>.weight_scale_inv``); the others pass unchanged. Give the result to
    ``send_weights``; quantizing runs on the tensors' device, one tensor at a time."""
    async for name, tensor in aiter_weights(weights):
        if quantize(name, tensor):
            q, scale = quantize_fp8_blocks(tensor, block)
            yield name, q
            yield f"{name}_scale_inv", scale
        else:
            yield name, tensor


def dequantize_fp8_blocks(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """``q`` times its block's scale, in ``float32`` (what an fp8 GEMM multiplies by)."""
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * expanded[:rows, :cols]
