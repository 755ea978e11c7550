"""Benchmark: weight updates into a live ``vllm.LLM`` through rlwire's weight-transfer engines.

    python -m rlwire.ckpt_engine.vllm.bench [--backends shm,gloo] [--layers 6] [--hidden 896]
        [--vocab 32000] [--changed 0.01] [--updates 5]

One process per backend (an in-process vLLM engine changes its host process): a Qwen2-shaped
fp32 model (random weights) served by ``vllm.LLM`` with ``rlwire_<backend>``, updated through
vLLM's trainer-side API (:class:`~rlwire.ckpt_engine.vllm.RlwireTrainerInitInfo`,
``delta="on"``) from the same process. Rows, median of ``--updates`` after a warm-up:

- ``dense``: every element changed; the whole model crosses and is written in.
- ``delta``: ``--changed`` of the elements of every tensor changed; only they cross, applied
  onto the receiver's copy of the version it holds, then written in (every layer: each
  has a changed tensor).
- ``delta, one layer``: the same share of the elements of the first decoder layer's
  tensors only: vLLM's loader rewrites that layer alone.
- ``vLLM reload``: the same weights handed to vLLM's own ``reload_weights`` in the same
  process (no transport at all: the floor any transfer adds to; vLLM's own NCCL and IPC
  engines do not run on a CPU host).
- ``copy``: ``dst.copy_(src)`` of the model's bytes into memory touched before (the
  memory-bandwidth reference).

``transfer``: the sender's ``TransferStats.seconds`` (until every receiver holds the whole
update beside the model); ``end-to-end``: from ``send_weights`` until vLLM serves the new
weights (the transfer, then vLLM's checkpoint-format loader writing them in).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PREFIX = "ROW "
ONE_LAYER = "model.layers.0."


def build_model(directory: Path, *, layers: int, hidden: int, vocab: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 16 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    build: Any = Qwen2ForCausalLM  # (untyped in transformers before 5.24)
    build(config).save_pretrained(directory)
    return directory


def _sparse(
    weights: dict[str, torch.Tensor], changed: float, seed: int, only: str = ""
) -> dict[str, torch.Tensor]:
    """``changed`` of the elements of each tensor whose name holds ``only`` move a little."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if only not in name:
            out[name] = t
            continue
        t = t.clone()
        flat = t.view(-1)
        k = max(1, int(flat.numel() * changed))
        flat[torch.randint(0, flat.numel(), (k,), generator=g)] += 1e-3
        out[name] = t
    return out


def child(model_dir: str, backend: str, changed: float, updates: int) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from rlwire.ckpt_engine.vllm import LLMClient, RlwireTrainerInitInfo

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
        weight_transfer_config={"backend": f"rlwire_{backend}"},
    )
    info = RlwireTrainerInitInfo(
        backend=f"rlwire_{backend}", rank=0, delta="on", bucket_size="512MiB", timeout=600
    )
    sender = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm))
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    # (seconds end to end, bytes that travelled, seconds of the transfer)
    rows: dict[str, list[tuple[float, float, float]]] = {
        "dense": [],
        "delta": [],
        "delta, one layer": [],
        "vLLM reload": [],
        "copy": [],
    }
    for i in range(updates + 1):  # the first round warms up
        dense = {name: t * (1.0 + 1e-3 * (i + 1)) for name, t in weights.items()}
        start = time.perf_counter()
        stats = sender.send_weights(dense.items())
        rows["dense"].append((time.perf_counter() - start, stats.wire_bytes, stats.seconds))
        sparse = _sparse(dense, changed, seed=i)
        start = time.perf_counter()
        stats = sender.send_weights(sparse.items())
        assert stats.base is not None, "the sparse update was not sent as a delta"
        rows["delta"].append((time.perf_counter() - start, stats.wire_bytes, stats.seconds))
        one = _sparse(sparse, changed, seed=i, only=ONE_LAYER)
        start = time.perf_counter()
        stats = sender.send_weights(one.items())
        assert stats.base is not None, "the one-layer update was not sent as a delta"
        rows["delta, one layer"].append(
            (time.perf_counter() - start, stats.wire_bytes, stats.seconds)
        )
        items = list(sparse.items())
        start = time.perf_counter()
        llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(items), "is_checkpoint_format": True}
        )
        rows["vLLM reload"].append((time.perf_counter() - start, 0, 0.0))
        if i == 0:  # allocated once, touched before timing: the memory-bandwidth reference
            src = torch.cat([t.view(-1).view(torch.uint8) for t in sparse.values()])
            dst = torch.empty_like(src).copy_(src)
        start = time.perf_counter()
        dst.copy_(src)
        rows["copy"].append((time.perf_counter() - start, 0, 0.0))
    sender.shutdown()
    for what, values in rows.items():
        kept = values[1:]
        seconds = statistics.median(v[0] for v in kept)
        wire = statistics.median(v[1] for v in kept)
        transfer = statistics.median(v[2] for v in kept)
        print(PREFIX + json.dumps({"backend": backend, "what": what, "seconds": seconds,
                                   "transfer": transfer, "wire_bytes": wire, "bytes": nbytes}),
              flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="shm,gloo")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument(
        "--child", nargs=2, metavar=("MODEL_DIR", "BACKEND"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.changed, args.updates)
        return
    with tempfile.TemporaryDirectory(prefix="rlwire-vllm-bench-") as tmp:
        model = build_model(Path(tmp) / "model", layers=args.layers, hidden=args.hidden,
                            vocab=args.vocab)  # fmt: skip
        rows = []
        for backend in args.backends.split(","):
            out = subprocess.run(
                [sys.executable, "-m", "rlwire.ckpt_engine.vllm.bench", "--child", str(model),
                 backend, "--changed", str(args.changed), "--updates", str(args.updates)],
                capture_output=True, text=True, timeout=3600,
            )  # fmt: skip
            if out.returncode != 0:
                raise SystemExit(f"{backend}: exit {out.returncode}\n{out.stderr[-3000:]}")
            rows += [
                json.loads(x[len(PREFIX) :])
                for x in out.stdout.splitlines()
                if x.startswith(PREFIX)
            ]
    mb = rows[0]["bytes"] / 1e6
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32, "
          f"{mb:.1f} MB; delta rows: {args.changed:.0%} of every tensor changed")  # fmt: skip
    print("| backend | update | wire MB | transfer s | vs dense | end-to-end s | vs dense "
          "| vs vLLM reload | vs copy |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for backend in args.backends.split(","):
        mine = {r["what"]: r for r in rows if r["backend"] == backend}
        for what in ("dense", "delta", "delta, one layer", "vLLM reload", "copy"):
            r = mine[what]
            sent = what.startswith(("dense", "delta"))
            wire = f"{r['wire_bytes'] / 1e6:.1f}" if sent else ""
            transfer = f"{r['transfer']:.3f}" if sent else ""
            vs = f"{r['transfer'] / mine['dense']['transfer']:.2f}x" if sent else ""
            print(f"| {backend} | {what} | {wire} | {transfer} | {vs} | {r['seconds']:.3f} | "
                  f"{r['seconds'] / mine['dense']['seconds']:.2f}x | "
                  f"{r['seconds'] / mine['vLLM reload']['seconds']:.2f}x | "
                  f"{r['seconds'] / mine['copy']['seconds']:.1f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
