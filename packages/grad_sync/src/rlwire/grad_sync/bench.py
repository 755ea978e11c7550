"""Benchmark: DEFER vs EVERY step time and retained memory, one table from one run.

    python -m rlwire.grad_sync.bench [--world-size 2] [--accum 1,2,4,8] [--hidden 1024]
                                     [--device cpu|cuda]

Spawns ``--world-size`` ranks (gloo on the CPU; NCCL, one GPU each, with ``--device cuda``)
running an FSDP2 MLP with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. For
each number of micro-batches it times optimizer steps under both policies in the same
processes (the EVERY time is the baseline) and reports the bytes retained between
micro-batches, measured on the live module and predicted beforehand. On CUDA it also reads
the caching allocator: the bytes allocated between micro-batches above the step's start,
for each policy, beside what the prediction says they are (the retained bytes, plus the
sharded gradient once a reduction has made it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ._launch import spawn
from ._sync import predict_retained_grad_bytes, retained_grad_bytes, run_micro_batches


def _build(hidden: int, layers: int, wrapper: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    model = nn.Sequential(*blocks).to(device)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model:
            if isinstance(block, nn.Linear):
                fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)  # makes model itself an FSDPModule
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    return FullyShardedDataParallel(
        model,
        device_id=device,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )


def _allocated(device: torch.device) -> int:
    """Bytes the CUDA caching allocator has handed out now (0 on the CPU: not read there)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _one_step(
    model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor, accum: int, policy: str
) -> tuple[float, int, int]:
    """One optimizer step of ``accum`` micro-batches: (seconds, max retained bytes, max bytes
    allocated on the device between micro-batches above the step's start)."""
    held: list[int] = []
    allocated: list[int] = []
    base = _allocated(batch.device)

    def micro_step(x: torch.Tensor) -> None:
        model(x).float().pow(2).mean().backward()
        held.append(retained_grad_bytes(model))
        if len(held) < accum:  # between micro-batches: not after the final one
            allocated.append(_allocated(x.device) - base)

    start = time.perf_counter()
    run_micro_batches(model, [batch] * accum, micro_step, policy=policy)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return time.perf_counter() - start, max(held), max(allocated, default=0)


def _sharded_grad_bytes(model: nn.Module) -> int:
    """This rank's sharded gradients (in the parameters' dtype), once a reduction made them."""
    return sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in model.parameters()
    )


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, float]]:
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = _build(args.hidden, args.layers, args.wrapper, device)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randn(args.micro_batch_size, args.hidden, generator=gen).to(device)
    rows: list[dict[str, float]] = []
    for accum in args.accum:
        times: dict[str, list[float]] = {"every": [], "defer": []}
        held: dict[str, int] = {"every": 0, "defer": 0}
        allocated: dict[str, int] = {"every": 0, "defer": 0}
        # Interleave the policies (order alternating) so drift hits both alike.
        for i in range(args.warmup + args.steps):
            order = ("every", "defer") if i % 2 == 0 else ("defer", "every")
            for policy in order:
                seconds, retained, live = _one_step(model, optim, batch, accum, policy)
                held[policy] = max(held[policy], retained)
                allocated[policy] = max(allocated[policy], live)
                if i >= args.warmup:
                    times[policy].append(seconds)
        row: dict[str, float] = {"accum": accum}
        for policy in ("every", "defer"):
            row[f"{policy}_s"] = statistics.median(times[policy])
            row[f"{policy}_retained"] = held[policy]
            # With a single micro-batch nothing is ever deferred.
            predicted = predict_retained_grad_bytes(model, policy=policy)
            row[f"{policy}_predicted"] = predicted if accum > 1 else 0
            row[f"{policy}_allocated"] = allocated[policy]
        # Between micro-batches EVERY holds the sharded gradient its reductions made; DEFER
        # holds the unsharded one and no sharded gradient yet (zero_grad set them to None).
        row["sharded_grad"] = _sharded_grad_bytes(model) if accum > 1 else 0
        rows.append(row)
    return rows


def _mib(n: float) -> str:
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
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank"
    )
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < args.world_size:
        parser.error(
            f"--device cuda --world-size {args.world_size} needs {args.world_size} GPUs "
            f"(NCCL takes one per rank); {torch.cuda.device_count()} here"
        )

    rows = spawn(_worker, args.world_size, args, timeout=args.timeout, device=args.device)[0]
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    where = f"NCCL on {torch.cuda.get_device_name()}" if cuda else "gloo CPU"
    print(
        f"{args.wrapper} bf16 params / fp32 reduce, {where}, world size {args.world_size}, "
        f"{params:,} parameters, micro-batch {args.micro_batch_size}, "
        f"median of {args.steps} steps"
    )
    _print_table(
        [
            "micro-batches",
            "EVERY step ms",
            "DEFER step ms",
            "DEFER/EVERY time",
            "DEFER retained MiB (measured)",
            "DEFER retained MiB (predicted)",
            "EVERY retained MiB",
        ],
        [
            [
                r["accum"],
                f"{r['every_s'] * 1e3:.1f}",
                f"{r['defer_s'] * 1e3:.1f}",
                f"{r['defer_s'] / r['every_s']:.2f}",
                _mib(r["defer_retained"]),
                _mib(r["defer_predicted"]),
                _mib(r["every_retained"]),
            ]
            for r in rows
        ],
    )
    if cuda:
        print()
        print(
            "CUDA allocator, bytes allocated between micro-batches above the step's start "
            "(max over steps)"
        )
        _print_table(
            [
                "micro-batches",
                "DEFER MiB (allocator)",
                "DEFER MiB (predicted)",
                "EVERY MiB (allocator)",
                "EVERY MiB (predicted: sharded gradient)",
            ],
            [
                [
                    r["accum"],
                    _mib(r["defer_allocated"]),
                    _mib(r["defer_predicted"]),
                    _mib(r["every_allocated"]),
                    _mib(r["sharded_grad"]),
                ]
                for r in rows
                if r["accum"] > 1
            ],
        )


def _print_table(header: list[str], rows: list[list[object]]) -> None:
    """A Markdown table, every column right-aligned."""
    print("| " + " | ".join(header) + " |")
    print("|---:" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


if __name__ == "__main__":
    main()
