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
holds the new version, and the offloaded actor left no parameter on the device. It prints one
table (the device named) and writes it to ``--out`` as Markdown.

    python -m rlwire.trainer.tools.device_check [--device cuda] [--steps 3] [--out DIR]
                                          [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..algorithms.advantages import compute_advantages
from ..algorithms.scoring import score
from ..config.root import TrainerConfig, load_config
from ..data.dataset import load_data
from ..data.rewards import load_reward
from ..models.tiny import build_tiny_model
from ..rollout import HFEngine
from ..runtime.hybrid import HybridWorker

__all__ = ["check_config", "main", "run_check", "table"]


def check_config(model_path: str, steps: int) -> TrainerConfig:
    """The checked job: one FSDP2 rank in bf16 with offload, its ``hf`` rollout engine in the
    same process, digests of every sync."""
    return load_config(
        overrides=[
            f"model.path={model_path}",
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
            metrics = worker.train(dataclasses.replace(batch, texts=[], examples=[]))
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            offloaded = _allocated(device)
            params = worker.actor.model.named_parameters()
            left = [name for name, p in params if _storage_device(p).type != "cpu"]
            if left:
                raise AssertionError(f"step {step}: offloaded, yet on the device: {left}")
            synced = _synced(worker, step + 1)
            rows.append(
                {
                    "step": step + 1,
                    "reward_mean": float(scored.rewards.mean()),
                    "generate_s": generate_s,
                    "update_s": metrics["time_actor_s"],
                    "sync_s": synced["weight_sync_s"] + synced["time_weight_export_s"],
                    "sync_bytes": synced["weight_sync_bytes"],
                    "digest": synced["digest"][:12],
                    "update_peak_bytes": peak,
                    "offloaded_bytes": offloaded,
                }
            )
        engine = worker.rollout.backend
        assert isinstance(engine, HFEngine)  # check_config's rollout.backend=hf
        return rows, sum(p.numel() for p in engine.model.parameters())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def table(rows: list[dict], device: torch.device, params: int) -> str:
    """The check's Markdown table, headed by the device and the stack."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"rlwire.trainer.tools.device_check on {name}: torch {torch.__version__}, Python "
        f"{sys.version.split()[0]}; one FSDP2 rank (bf16 compute, fp32 reduce, offload) and "
        f"its hf rollout engine in one process (hybrid engine), a tiny model of {params:,} "
        "parameters",
        "",
        "| step | reward mean | generate s | update s | sync s | sync MiB | digest (equal) "
        "| update peak MiB | after offload MiB |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['reward_mean']:.3f} | {r['generate_s']:.3f} "
            f"| {r['update_s']:.3f} | {r['sync_s']:.4f} | {_mib(r['sync_bytes'])} "
            f"| {r['digest']} | {_mib(r['update_peak_bytes'])} | {_mib(r['offloaded_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64, help="the tiny model's width")
    parser.add_argument("--layers", type=int, default=2, help="the tiny model's depth")
    parser.add_argument("--out", default=None, help="write device_check.md here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    if args.device == "cpu":  # the workers take a GPU wherever there is one: hide it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="rlwire-device-check-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", hidden=args.hidden, layers=args.layers)
        model_path = str(model)
        config = check_config(model_path, args.steps)
        rows, params = run_check(config, model_path)
    text = table(rows, torch.device(args.device), params)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "device_check.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
