"""fp8 weights quantized on the sender: exact against quantizing on the receiver, and sent
as deltas over the quantized bytes."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_pair import joined_pair  # this folder: pytest puts it on sys.path

from rlwire.ckpt_engine import (
    apply_to_module,
    dequantize_fp8_blocks,
    fp8_weights,
    quantize_fp8_blocks,
)


def _reference(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block, as a receiver quantizing its own copy would (one block at a time,
    no padding): DeepGEMM's and vLLM's formula."""
    rows, cols = weight.shape
    br, bc = block
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // br), -(-cols // bc), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scale = part.abs().float().amax().clamp(min=1e-4) / 448.0
            # in float32, as vLLM's (a bf16 block times a float32 scale tensor promotes)
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (part.float() * (1.0 / scale)).to(
                torch.float8_e4m3fn
            )
            scales[i, j] = scale
    return q, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "block"), [((300, 520), (128, 128)), ((64, 64), (32, 16))])
def test_fp8_block_quantization_is_exact_against_the_receivers(dtype, shape, block):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    weight[: block[0], : block[1]] = 0  # an all-zero block keeps a finite scale
    weight[-1, -1] = 3.0  # an outlier in the last, partial block
    q, scale = quantize_fp8_blocks(weight, block)
    ref_q, ref_scale = _reference(weight, block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.shape == weight.shape and scale.shape == ref_scale.shape
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    back = dequantize_fp8_blocks(q, scale, block)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each block's largest value
    err = (back - weight.float()).abs()
    bound = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert bool((err <= bound[: shape[0], : shape[1]] * 448 / 16).all())
    with pytest.raises(ValueError, match=r"^fp8 block quantization takes a 2-D weight"):
        quantize_fp8_blocks(weight.view(-1))


def test_fp8_weights_quantize_linear_layers_only():
    state = {
        "model.embed_tokens.weight": torch.randn(50, 16).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16).bfloat16(),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.randn(16).bfloat16(),
        "model.norm.weight": torch.randn(16).bfloat16(),
        "lm_head.weight": torch.randn(50, 16).bfloat16(),
    }

    async def collect() -> dict[str, torch.Tensor]:
        return {name: t async for name, t in fp8_weights(state.items())}

    out = asyncio.run(collect())
    assert list(out) == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert out[name] is state[name]


def test_fp8_deltas_send_only_the_quantized_bytes_that_changed():
    """bf16 weights under small steps, quantized on the sender each update and sent with
    ``delta="on"`` through shm: the receiver holds exactly the sender's quantization after
    every update, and a delta carries only the fp8 values and scales that moved."""
    torch.manual_seed(0)
    linear = {f"layers.{i}.mlp.up_proj.weight": torch.randn(256, 384).bfloat16() for i in range(2)}
    first = asyncio.run(_collect(fp8_weights(linear.items())))
    held = {name: torch.zeros_like(t) for name, t in first.items()}  # the fp8 checkpoint's
    tx, rx, _ = joined_pair(bucket_size=1 << 20, timeout=20, sender={"delta": "on"})

    async def run() -> list:
        version, stats = None, []
        for v in range(1, 4):
            for t in linear.values():  # a small step: the lowest bf16 bit of 1% of elements
                t.view(torch.int16)[torch.rand(t.shape) < 0.01] ^= 1
            s, version = await asyncio.gather(
                tx.send_weights(fp8_weights(linear.items()), version=v),
                apply_to_module(held, rx, version=version),
            )
            for name, t in (await _collect(fp8_weights(linear.items()))).items():
                assert torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)), (v, name)
            stats.append(s)
        return stats

    try:
        stats = asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()
    fp8_bytes = sum(t.numel() * t.element_size() for t in first.values())
    bf16_bytes = sum(t.numel() * 2 for t in linear.values())
    assert stats[0].bytes == fp8_bytes < bf16_bytes * 0.51  # half of bf16, plus the scales
    assert [s.base for s in stats] == [None, 1, 2]
    for s in stats[1:]:  # few fp8 values cross a step when the bf16 ones move by one ulp
        assert 0 < s.changed < s.elements * 0.01 and s.wire_bytes < fp8_bytes * 0.02, s


async def _collect(items) -> dict[str, torch.Tensor]:
    return {name: t.clone() async for name, t in items}
