"""Benchmark: DEFER vs EVERY step time and retained memory, one table from one run.

    python -m rlwire.grad_sync.bench [--world-size 2] [--accum 1,2,4,8] [--hidden 1024]

Spawns ``--world-size`` gloo ranks (CPU) running an FSDP2 MLP with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. For each number
of micro-batches it times optimizer steps under both policies in the same
processes (the EVERY time is the baseline) and reports the bytes retained
between micro-batches, measured on the live module and predicted beforehand.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ._launch import spawn
from ._sync import predict_retained_grad_bytes, retained_grad_bytes, run_micro_batches


def _build(hidden: int, layers: int, wrapper: str) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    model = nn.Sequential(*blocks)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model:
            if isinstance(block, nn.Linear):
                fully_shard(block, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    return FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )


def _one_step(model: nn.Module, optim, batch: torch.Tensor, accum: int, policy: str) -> tuple:
    """One optimizer step of ``accum`` micro-batches; (seconds, max retained bytes)."""
    held: list[int] = []

    def micro_step(x: torch.Tensor) -> None:
        model(x).float().pow(2).mean().backward()
        held.append(retained_grad_bytes(model))

    start = time.perf_counter()
    run_micro_batches(model, [batch] * accum, micro_step, policy=policy)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return time.perf_counter() - start, max(held)


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    model = _build(args.hidden, args.layers, args.wrapper)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randn(args.micro_batch_size, args.hidden, generator=gen)
    rows = []
    for accum in args.accum:
        times: dict[str, list[float]] = {"every": [], "defer": []}
        held: dict[str, int] = {"every": 0, "defer": 0}
        # Interleave the policies (order alternating) so drift hits both alike.
        for i in range(args.warmup + args.steps):
            order = ("every", "defer") if i % 2 == 0 else ("defer", "every")
            for policy in order:
                seconds, retained = _one_step(model, optim, batch, accum, policy)
                held[policy] = max(held[policy], retained)
                if i >= args.warmup:
                    times[policy].append(seconds)
        row: dict = {"accum": accum}
        for policy in ("every", "defer"):
            row[f"{policy}_s"] = statistics.median(times[policy])
            row[f"{policy}_retained"] = held[policy]
            # With a single micro-batch nothing is ever deferred.
            predicted = predict_retained_grad_bytes(model, policy=policy)
            row[f"{policy}_predicted"] = predicted if accum > 1 else 0
        rows.append(row)
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--accum", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    parser.add_argument("--wrapper", choices=["fsdp2", "fsdp1"], default="fsdp2")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per policy (median reported)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)

    rows = spawn(_worker, args.world_size, args, timeout=args.timeout)[0]
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    print(
        f"{args.wrapper} bf16 params / fp32 reduce, gloo CPU, world size {args.world_size}, "
        f"{params:,} parameters, micro-batch {args.micro_batch_size}, "
        f"median of {args.steps} steps"
    )
    header = (
        "| micro-batches | EVERY step ms | DEFER step ms | DEFER/EVERY time "
        "| DEFER retained MiB (measured) | DEFER retained MiB (predicted) | EVERY retained MiB |"
    )
    print(header)
    print("|---:" * (header.count("|") - 1) + "|")
    for r in rows:
        print(
            f"| {r['accum']} | {r['every_s'] * 1e3:.1f} | {r['defer_s'] * 1e3:.1f} "
            f"| {r['defer_s'] / r['every_s']:.2f} | {_mib(r['defer_retained'])} "
            f"| {_mib(r['defer_predicted'])} | {_mib(r['every_retained'])} |"
        )


if __name__ == "__main__":
    main()
