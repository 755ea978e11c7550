"""Benchmark: end-to-end weight-update time against a plain copy of the same bytes.

    python -m rlwire.ckpt_engine.bench --backend shm --gib 1 --receivers 2

Starts one sender and ``--receivers`` receiver processes. Each update sends
``--gib`` GiB of fp32 tensors (``--tensor-mib`` each); every receiver copies
each tensor into its own preallocated destination (``copy=False`` views, so
this is the only receiver-side copy). Reported: end-to-end seconds from the
start of ``send_weights`` until every receiver has written the last tensor
(median over ``--updates`` after one warm-up update), GB/s, and the ratio to
a plain ``dst.copy_(src)`` of the same bytes in the sender process (the
memory-bandwidth limit), measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

from ._registry import registry

_CUDA_BACKENDS = ("cuda_ipc", "nccl")


def _device(backend: str, rank: int) -> torch.device:
    if backend not in _CUDA_BACKENDS:
        return torch.device("cpu")
    # nccl: one GPU per member; cuda_ipc: everyone on the master's GPU
    index = rank % torch.cuda.device_count() if backend == "nccl" else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _weights(gib: float, tensor_mib: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    total = int(gib * (1 << 30)) // 4
    per = tensor_mib * (1 << 20) // 4
    sizes = [per] * (total // per) + ([total % per] if total % per else [])
    return [
        (f"layer.{i}.weight", torch.full((n,), float(i), device=device))
        for i, n in enumerate(sizes)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _options(args: argparse.Namespace, master: bool, root: str) -> dict:
    options = {"bucket_size": args.bucket_size, "timeout": args.timeout, "is_master": master}
    if args.backend == "filesystem":
        options["root"] = root
    return options


def _receiver(rank: int, args, root: str, meta_q, done_q) -> None:
    torch.set_num_threads(args.threads)
    device = _device(args.backend, rank)
    engine = registry.new(args.backend, **_options(args, False, root))
    engine.prepare()
    meta = meta_q.get(timeout=args.timeout)
    engine.init_process_group(rank=rank, world_size=args.receivers + 1, master_metadata=meta)
    dest = {name: torch.empty_like(t) for name, t in _weights(args.gib, args.tensor_mib, device)}

    async def run() -> None:
        for _ in range(args.updates + 1):
            async for name, tensor in engine.receive_weights(copy=False):
                dest[name].copy_(tensor)
            _sync(device)  # "written into its destination" means on the device
            done_q.put((rank, engine.last_version, time.monotonic()))

    asyncio.run(run())
    engine.finalize()


def _plain_copy_seconds(weights: list[tuple[str, torch.Tensor]], device: torch.device) -> float:
    dst = [torch.empty_like(t) for _, t in weights]
    times = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for d, (_, s) in zip(dst, weights, strict=True):
            d.copy_(s)
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)  # the best of five: the machine's limit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend", default="shm", choices=["gloo", "shm", "filesystem", *_CUDA_BACKENDS]
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--bucket-size", default="64MiB")
    parser.add_argument("--updates", type=int, default=3, help="timed updates after a warm-up")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--share",
        action="store_true",
        help="shm: move the sender's weights into shared memory first",
    )
    args = parser.parse_args(argv)

    if args.backend in _CUDA_BACKENDS and not torch.cuda.is_available():
        print(f"rlwire.ckpt_engine.bench: {args.backend} needs CUDA; none on this machine")
        return
    if args.backend == "nccl" and args.receivers + 1 > torch.cuda.device_count():
        print(
            f"rlwire.ckpt_engine.bench: nccl needs one GPU per member ({args.receivers + 1}); "
            f"this machine has {torch.cuda.device_count()}"
        )
        return
    device = _device(args.backend, 0)
    weights = _weights(args.gib, args.tensor_mib, device)
    nbytes = sum(t.numel() * 4 for _, t in weights)
    # A plain copy of the same bytes: host memory bandwidth on the CPU, device-to-device on GPUs.
    plain = _plain_copy_seconds(
        weights, device
    )  # with torch's default threads: the machine's limit
    # Sender and receivers share the cores: one thread each avoids OpenMP
    # oversubscription (idle-spinning threads stalling every parallel copy).
    torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="rlwire-ckpt-bench-")
    ctx = mp.get_context("spawn")
    meta_q, done_q = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_receiver, args=(r, args, root, meta_q, done_q), daemon=True)
        for r in range(1, args.receivers + 1)
    ]
    for p in procs:
        p.start()
    engine = registry.new(args.backend, **_options(args, True, root))
    meta = engine.prepare()
    for _ in procs:
        meta_q.put(meta)
    engine.init_process_group(rank=0, world_size=args.receivers + 1, master_metadata=meta)
    if args.share:
        engine.share_weights(weights)  # once, before the timed updates

    async def run() -> list[float]:
        seconds = []
        for version in range(args.updates + 1):
            start = time.monotonic()
            await engine.send_weights(weights, version=version)
            ends = [done_q.get(timeout=args.timeout)[2] for _ in procs]
            if version > 0:
                seconds.append(max(ends) - start)
        return seconds

    try:
        seconds = statistics.median(asyncio.run(run()))
    finally:
        engine.finalize()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if args.backend == "filesystem":
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        else:
            os.rmdir(root)
    print(
        f"{args.backend}: {nbytes / 2**30:.2f} GiB in {len(weights)} fp32 tensors to "
        f"{args.receivers} receivers, bucket {args.bucket_size}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}"
    )
    label = args.backend + (" (share_weights)" if args.share else "")
    print("| backend | receivers | end-to-end s | GB/s | plain copy s | ratio to plain copy |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| {label} | {args.receivers} | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} "
        f"| {plain:.3f} | {plain / seconds:.2f} |"
    )


if __name__ == "__main__":
    main()
