"""The trainer's engines on one device, without Ray: ``python -m
rlwire.trainer.tools.device_check``.

What a GPU machine without Ray (or a CI run, on the CPU) can check of the trainer: one actor
rank (FSDP2 with bf16 compute and fp32 reduction) and its rollout engine (``hf``) in this
process, as the hybrid engine places them (``rollout.hybrid_engine``), over the built-in
tiny model. Each step generates, scores, computes the GRPO advantages, trains (the actor
reloaded from the host for the update and offloaded after it: ``actor.offload``) and hands
the weights to the rollout engine on the device (the ``naive`` checkpoint engine, no copy
through the host). It fails, naming what differed, unless after every sync the digest of
what the actor sent equals the digest of what the rollout engine holds, the rollout engine
holds the new version, and the offloaded actor left no parameter on the device once the sync
is over. Beside each sync it times one digest of the rollout engine's weights on the device
(:func:`~rlwire.trainer.rollout.weights_digest`, read back once) against one device copy of
the same bytes, the bound of a pass over them. It prints one table (the device named) and
writes it to ``--out`` as Markdown.

    python -m rlwire.trainer.tools.device_check [--device cuda] [--steps 3] [--out DIR]
                                          [--hidden 64] [--layers 2]
                                          [--shape qwen2.5-0.5b [--layers N]]

``--shape qwen2.5-0.5b``: instead of the tiny model, Qwen2.5-0.5B's architecture (hidden
896, 24 layers, 14 query and 2 key-value heads, MLP 4864, a vocabulary of 151,936, tied
embeddings) with random weights, in bf16 (nothing is downloaded; ``--layers`` shortens it
for a CPU rehearsal). Each row prints the sync beside one device copy of the same bytes
and as milliseconds per GB sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..algorithms.advantages import compute_advantages
from ..algorithms.scoring import score
from ..config.root import TrainerConfig, load_config
from ..data.dataset import load_data
from ..data.rewards import load_reward
from ..models.tiny import build_tiny_model
from ..rollout import HFEngine, weights_digest
from ..runtime.hybrid import HybridWorker

__all__ = ["check_config", "main", "run_check", "table"]


REAL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
}
"""Real models' architectures (their ``config.json`` fields) the check builds with random
weights."""


def build_real_shape(directory: Path, shape: str, layers: int | None = None) -> Path:
    """``shape``'s architecture (:data:`REAL_SHAPES`), random bf16 weights and the built-in
    tokenizer (its ids fit the larger vocabulary), saved in ``directory``; ``layers``
    overrides the depth."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ..models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    fields = {**REAL_SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    config = Qwen2Config(
        **fields,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).bfloat16()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def check_config(model_path: str, steps: int, dtype: str = "float32") -> TrainerConfig:
    """The checked job: one FSDP2 rank in bf16 with offload, its ``hf`` rollout engine in the
    same process, digests of every sync; ``dtype``: the parameters' (``model.dtype``)."""
    return load_config(
        overrides=[
            f"model.path={model_path}",
            f"model.dtype={dtype}",
            "actor.strategy=fsdp2",
            "actor.world_size=1",
            "actor.mixed_precision=true",
            "actor.offload=true",
            "rollout.backend=hf",
            "rollout.hybrid_engine=true",
            "ckpt_engine.digest=true",
            f"trainer.steps={steps}",
        ]
    )


def _allocated(device: torch.device) -> int | None:
    """Bytes the CUDA caching allocator has handed out (None on the CPU: not measured)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _storage_device(param: torch.Tensor) -> torch.device:
    """Where a parameter's data lives: an FSDP2 ``DTensor`` keeps the device it was built on
    as its own, while offload moves its local shard."""
    return (param.to_local() if hasattr(param, "to_local") else param).device


def _digest_cost(
    items: list[tuple[str, torch.Tensor]], device: torch.device
) -> tuple[float, float]:
    """Seconds of one :func:`weights_digest` of ``items`` on their device, and of one copy
    of the same bytes on it (the bound of a pass over them), each timed from an idle device
    to its end."""

    def timed(work) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    flat = torch.cat([value.detach().reshape(-1).view(torch.uint8) for _, value in items])
    copy_s = min(timed(lambda: flat.clone()) for _ in range(3))
    digest_s = min(timed(lambda: weights_digest(items)) for _ in range(3))
    return digest_s, copy_s


def _synced(worker: HybridWorker, version: int) -> dict:
    """Hand ``version`` over and check that it arrived whole."""
    report = worker.sync_weights(version)
    pulled = report["pull"]
    if pulled["version"] != version:
        raise AssertionError(f"sync {version}: the rollout engine holds {pulled['version']}")
    if report["digest"] != pulled["digest"]:
        raise AssertionError(
            f"sync {version}: the actor sent {report['digest']}, the rollout engine holds "
            f"{pulled['digest']}"
        )
    return report


def _hf(worker: HybridWorker) -> HFEngine:
    engine = worker.rollout.backend
    assert isinstance(engine, HFEngine)  # check_config's rollout.backend=hf
    return engine


def _sync_row(worker: HybridWorker, synced: dict) -> dict:
    """A row's sync columns (and every other left None): the sync's seconds and bytes, its
    digest, and one digest and one device copy of what the rollout engine holds."""
    state = list(_hf(worker).model.state_dict().items())
    digest_s, copy_s = _digest_cost(state, worker.device)
    return {
        "reward_mean": None,
        "generate_s": None,
        "update_s": None,
        "update_peak_bytes": None,
        "offloaded_bytes": None,
        "sync_s": synced["weight_sync_s"] + synced["time_weight_export_s"],
        "sync_bytes": synced["weight_sync_bytes"],
        "digest": synced["digest"][:12],
        "digest_s": digest_s,
        "copy_s": copy_s,
    }


def run_check(config: TrainerConfig, model_path: str) -> tuple[list[dict], int]:
    """Run the check (see the module docstring): one row per step, and the model's
    parameter count."""
    import torch.distributed as dist

    worker = HybridWorker(config, model_path, 0)
    worker.setup(("127.0.0.1", 0))  # rank 0 of one: its store takes a free port
    try:
        worker.engine_init_hybrid()
        device = worker.device
        data, reward = load_data(config, Path(model_path)), load_reward(config)
        _synced(worker, 0)
        rows = []
        for step in range(config.trainer.steps):
            examples = data(step)
            start = time.perf_counter()
            batch = worker.generate(examples, config.trainer.seed + step)
            generate_s = time.perf_counter() - start
            batch.examples = [e for e in examples for _ in range(config.rollout.n)]
            scored = score(config, reward, batch)
            batch.rewards = scored.rewards
            batch.advantages = compute_advantages(
                config.algorithm, scored.rewards, batch.response_mask, config.rollout.n
            )
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            metrics = worker.train(
                dataclasses.replace(batch, texts=[], examples=[]), sync_follows=True
            )
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            synced = _synced(worker, step + 1)  # the actor is offloaded once it is over
            offloaded = _allocated(device)
            params = worker.actor.model.named_parameters()
            left = [name for name, p in params if _storage_device(p).type != "cpu"]
            if left:
                raise AssertionError(f"step {step}: offloaded, yet on the device: {left}")
            rows.append(
                {
                    **_sync_row(worker, synced),
                    "step": step + 1,
                    "reward_mean": float(scored.rewards.mean()),
                    "generate_s": generate_s,
                    "update_s": metrics["time_actor_s"],
                    "update_peak_bytes": peak,
                    "offloaded_bytes": offloaded,
                }
            )
        return rows, sum(p.numel() for p in _hf(worker).model.parameters())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_syncs(config: TrainerConfig, model_path: str, syncs: int) -> tuple[list[dict], int]:
    """``--syncs``: only the hand-over, ``syncs`` times (no generation, no update: the
    weights as loaded), each checked as :func:`run_check`'s and timed beside a device copy
    of the same bytes; rows as :func:`run_check`'s, with what was not run left None."""
    import torch.distributed as dist

    worker = HybridWorker(config, model_path, 0)
    worker.setup(("127.0.0.1", 0))
    try:
        worker.engine_init_hybrid()
        rows = []
        for version in range(syncs):
            rows.append({**_sync_row(worker, _synced(worker, version)), "step": f"sync {version}"})
        return rows, sum(p.numel() for p in _hf(worker).model.parameters())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def table(rows: list[dict], device: torch.device, params: int, model: str = "a tiny model") -> str:
    """The check's Markdown table, headed by the device, the stack and the date."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    kind = "GPU" if device.type == "cuda" else "CPU"
    lines = [
        f"rlwire.trainer.tools.device_check on {name} ({kind}, {time.strftime('%Y-%m-%d')}): "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}; one FSDP2 rank (bf16 "
        f"compute, fp32 reduce, offload) and its hf rollout engine in one process (hybrid "
        f"engine), {model} of {params:,} parameters",
        "",
        "| step | reward mean | generate s | update s | sync s | sync MiB | sync ms/GB "
        "| digest (equal) | digest ms | device copy ms | update peak MiB | after offload MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_gb = r["sync_s"] * 1e3 / (r["sync_bytes"] / 1e9) if r["sync_bytes"] else 0.0
        lines.append(
            f"| {r['step']} | {_num(r['reward_mean'], '.3f')} | {_num(r['generate_s'], '.3f')} "
            f"| {_num(r['update_s'], '.3f')} | {r['sync_s']:.4f} | {_mib(r['sync_bytes'])} "
            f"| {per_gb:.1f} "
            f"| {r['digest']} | {r['digest_s'] * 1e3:.2f} | {r['copy_s'] * 1e3:.2f} "
            f"| {_mib(r['update_peak_bytes'])} | {_mib(r['offloaded_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64, help="the tiny model's width")
    parser.add_argument("--layers", type=int, default=None, help="the model's depth (tiny: 2)")
    parser.add_argument(
        "--shape",
        choices=sorted(REAL_SHAPES),
        default=None,
        help="a real model's architecture, random bf16 weights",
    )
    parser.add_argument(
        "--syncs",
        type=int,
        default=0,
        help="only this many hand-overs of the weights as loaded (no steps, no offload)",
    )
    parser.add_argument("--out", default=None, help="write device_check.md here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    if args.device == "cpu":  # the workers take a GPU wherever there is one: hide it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="rlwire-device-check-") as tmp:
        if args.shape:
            model = build_real_shape(Path(tmp) / args.shape, args.shape, args.layers)
            described = f"{args.shape}'s architecture (random bf16 weights)"
        else:
            model = build_tiny_model(
                Path(tmp) / "tiny", hidden=args.hidden, layers=args.layers or 2
            )
            described = "a tiny model"
        model_path = str(model)
        config = check_config(model_path, args.steps, "bfloat16" if args.shape else "float32")
        if args.syncs:
            sync_only = dataclasses.replace(config.actor, offload=False)
            config = dataclasses.replace(config, actor=sync_only)
            rows, params = run_syncs(config, model_path, args.syncs)
        else:
            rows, params = run_check(config, model_path)
    text = table(rows, torch.device(args.device), params, described)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "device_check.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
