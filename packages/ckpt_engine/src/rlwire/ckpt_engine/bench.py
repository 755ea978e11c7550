"""Benchmark: end-to-end weight updates against a plain copy of the same bytes.

    python -m rlwire.ckpt_engine.bench --backend shm,gloo --shapes qwen2.5-0.5b
    python -m rlwire.ckpt_engine.bench --backend shm --gib 0.25,1,4
    python -m rlwire.ckpt_engine.bench --backend gloo --shapes qwen2.5-0.5b --delta --changed 0.01
    python -m rlwire.ckpt_engine.bench --backend shm,gloo --shapes qwen2.5-0.5b --lora-rank 16

One sender and ``--receivers`` receiver processes per row. The weights are a
real model's state dict (``--shapes``: names, shapes and bf16, generated
locally) or that model scaled to ``--gib`` GiB (``_shapes.scaled``). Every
receiver writes each tensor into its own preallocated destination (``copy=False``
views, so that is its only copy) or applies the delta onto it. Per row:

- ``seconds``: end-to-end, from ``send_weights`` until every receiver has
  written the last tensor (median of ``--updates`` after a warm-up update);
- ``copy_seconds``: a plain ``dst.copy_(src)`` of the same bytes in the sender
  process on the backend's device, same run (the memory-bandwidth limit; for
  ``cuda_ipc`` and ``nccl`` a device-to-device copy, ``copy_device``), and
  ``ratio_to_copy``;
- ``wire_bytes``: bytes that travelled (less than ``bytes`` for deltas);
- ``overlap``: ``seconds`` over the slowest stage alone: packing (sender time
  in copies or delta encoding, reported by the engine), transfer (an update
  whose receivers consume without writing) and applying (the slowest
  receiver's time writing); 1.0 = the stages fully overlap;
- ``peak_extra_buckets``: a receiver's peak memory beyond its destination
  (anonymous plus shared-memory pages it touched, sampled every millisecond
  during one more update; the sender's zero-copy arena excluded) over the bucket size.

``--delta`` adds, per ``--changed`` fraction, a row with ``delta="on"`` in which
that fraction of every tensor's elements changes between updates (the lowest
bit flips at random positions: a small optimizer step on bf16), with
``dense_seconds`` from the dense row of the same run; ``--compress`` adds each
delta row again with ``compress="zstd"``. ``--fp8`` adds the dense row (and with
``--delta`` the delta rows) again with the weights quantized on the sender in every
update (:func:`~rlwire.ckpt_engine.fp8_weights`: each linear layer's weight as
``float8_e4m3fn`` with its 128 x 128 block scales); its bytes and ``vs dense`` are
against the bf16 dense row, and its receivers hold the fp8 checkpoint's tensors. Each row ends by
checking every receiver's destination against the sender's weights (CRC-32).
``--lora-rank R`` adds, after each layout, its rank-``R`` LoRA adapter on every
linear layer (``_shapes.lora_layout``: what an adapter-only sync sends) and prints
the adapter's bytes and seconds against the dense rows of the same run.
``--in-place`` adds, for ``shm``, a row with weights used in place
(``share_weights(buffers=2)``): the sender copies each update into the arena the
receivers do not read, and each receiver takes the arena's tensors as its own
(:meth:`~rlwire.ckpt_engine.backends._shm.ShmEngine.receive_in_place`, a swap per
tensor) and says it left the older arena.
``--json`` prints one JSON object per row instead of the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import shutil
import tempfile
import time
from multiprocessing.queues import Queue
from typing import Any

import torch

from ._base import TransferStats
from ._bench_receiver import CUDA_BACKENDS, allocate, crc, device_for, options, receiver, sync
from ._bench_table import print_adapter_ratios, print_table
from ._delta import _words
from ._fp8 import FP8_BLOCK, fp8_weights, quantized_by_default
from ._registry import registry
from ._shapes import Layout, lora_layout, nbytes, scaled, shapes_by_name
from ._sizes import parse_bucket_size
from ._wire import aiter_weights
from .backends._shm import ShmEngine


def _plain_copy_seconds(weights: dict[str, torch.Tensor], device: torch.device) -> float:
    dst = {name: torch.empty_like(t) for name, t in weights.items()}
    times = []
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        for name, t in weights.items():
            dst[name].copy_(t)
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)  # the best of three: the machine's limit


def _change(weights: dict[str, torch.Tensor], share: float, gen: torch.Generator) -> None:
    """Flip the lowest bit of ``share`` of every tensor's elements, at random positions."""
    for t in weights.values():
        words = _words(t)
        assert words is not None  # the layouts' dtypes are 1 to 8 bytes wide
        k = round(words.numel() * share)
        if k:
            where = torch.randint(0, words.numel(), (k,), generator=gen)
            words[where] = words[where] ^ 1


def _run_row(
    args: argparse.Namespace, row: dict[str, Any], layout: Layout, weights: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """One group: warm-up, ``args.updates`` timed updates, one memory update, one transfer-only
    update, and the CRC check."""
    torch.set_num_threads(args.sender_threads or args.threads)
    root = tempfile.mkdtemp(prefix="rlwire-ckpt-bench-")
    ctx = mp.get_context("spawn")
    meta_q: Queue[dict[str, Any]] = ctx.Queue()
    done_q: Queue[tuple[Any, ...]] = ctx.Queue()
    cmd_qs: list[Queue[str | None]] = [ctx.Queue() for _ in range(args.receivers)]
    procs = [
        ctx.Process(
            target=receiver,
            args=(
                r,
                args,
                row,
                fp8_layout(layout) if row.get("fp8") else layout,
                root,
                meta_q,
                cmd_qs[r - 1],
                done_q,
            ),
            daemon=True,
        )
        for r in range(1, args.receivers + 1)
    ]
    for p in procs:
        p.start()
    engine = registry.new(row["backend"], **options(args, row, True, root))
    meta = engine.prepare()
    for _ in procs:
        meta_q.put(meta)
    engine.init_process_group(rank=0, world_size=args.receivers + 1, master_metadata=meta)
    if row["share"]:
        assert isinstance(engine, ShmEngine), "--share: shm's zero-copy (share_weights)"
        engine.share_weights(weights.items())  # once, before the timed updates
    if row.get("in_place"):
        assert isinstance(engine, ShmEngine), "--in-place: shm's share_weights(buffers=2)"
        engine.share_weights(weights.items(), buffers=2)
    gen = torch.Generator().manual_seed(0)
    items = list(weights.items())

    def sent() -> Any:  # fp8: quantized on the sender in every (timed) update
        return fp8_weights(items) if row.get("fp8") else items

    async def update(version: int, command: str) -> tuple[float, TransferStats, list[Any]]:
        if row["delta"] and version > 0:
            _change(weights, row["changed"], gen)  # between updates, not timed
        for q in cmd_qs:
            q.put(command)
        start = time.monotonic()
        stats = await engine.send_weights(sent(), version=version)
        answers = [done_q.get(timeout=args.timeout) for _ in procs]
        return max(a[1] for a in answers) - start, stats, answers

    async def run() -> dict[str, Any]:
        await update(0, "apply")  # warm-up (and the dense first update of a delta row)
        timed = [await update(v, "apply") for v in range(1, args.updates + 1)]
        _, _, memory = await update(args.updates + 1, "memory")
        for q in cmd_qs:
            q.put("crc")
        crcs = {done_q.get(timeout=args.timeout)[1] for _ in procs}
        identical = crcs == {crc(dict(await _materialize(sent())))}
        transfer, _, _ = await update(args.updates + 2, "consume")
        middle = sorted(timed, key=lambda t: t[0])[len(timed) // 2]
        seconds, stats, answers = middle
        apply_s = max(a[2] for a in answers)
        return {
            "seconds": seconds,
            "wire_bytes": stats.wire_bytes,
            "overlap": seconds / max(stats.pack_seconds, transfer, apply_s),
            "pack_seconds": stats.pack_seconds,
            "transfer_seconds": transfer,
            "apply_seconds": apply_s,
            "peak_extra": max(a[2] for a in memory),
            "bit_identical": identical,
            "density": stats.density,
        }

    try:
        result = asyncio.run(run())
    finally:
        for q in cmd_qs:
            q.put(None)
        engine.finalize()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    return result


async def _materialize(items: Any) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) async for name, t in aiter_weights(items)]


def fp8_layout(layout: Layout) -> Layout:
    """What the receivers of an fp8 row hold: ``layout`` as :func:`fp8_weights` sends it."""
    meta = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, shape, dtype in layout]
    out: Layout = []
    for name, t in meta:
        if quantized_by_default(name, t):
            rows, cols = t.shape
            blocks = (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
            out += [
                (name, t.shape, torch.float8_e4m3fn),
                (f"{name}_scale_inv", blocks, torch.float32),
            ]
        else:
            out.append((name, t.shape, t.dtype))
    return out


def _layouts(args: argparse.Namespace) -> list[tuple[str, Layout]]:
    if args.shapes:
        dense = [(args.shapes, shapes_by_name(args.shapes))]
    else:
        dense = [(f"qwen2-scaled-{g:g}GiB", scaled(g)) for g in args.gib]
    if not args.lora_rank:
        return dense
    rank = args.lora_rank
    return [
        pair
        for label, layout in dense
        for pair in ((label, layout), (f"{label} LoRA r{rank}", lora_layout(layout, rank)))
    ]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="shm", help="comma-separated: gloo, shm, ...")
    parser.add_argument("--shapes", default=None, help="a real model's layout: qwen2.5-0.5b")
    parser.add_argument("--gib", type=_floats, default=[1.0], help="scaled sizes, e.g. 0.25,1,4")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--bucket-size", default="512MiB")
    parser.add_argument("--updates", type=int, default=3, help="timed updates after a warm-up")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per receiver")
    parser.add_argument(
        "--sender-threads",
        type=int,
        default=None,
        help="torch threads of the sender (packing, delta encoding; default --threads)",
    )
    parser.add_argument("--share", action="store_true", help="shm: zero-copy (share_weights)")
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="shm: add a row with weights used in place (share_weights(buffers=2))",
    )
    parser.add_argument("--delta", action="store_true", help="add delta rows (--changed)")
    parser.add_argument("--changed", type=_floats, default=[0.01], help="changed fractions")
    parser.add_argument(
        "--compress", action="store_true", help="add each delta row again with compress='zstd'"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="add rows sending fp8 (quantized on the sender)"
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="add the LoRA adapter's rows")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    backends = [b for b in args.backend.split(",") if b]
    for backend in backends:
        if backend in CUDA_BACKENDS and not torch.cuda.is_available():
            parser.error(f"{backend} needs CUDA; none on this machine")
    bucket = parse_bucket_size(args.bucket_size)

    rows = []
    for label, layout in _layouts(args):
        size = nbytes(layout)
        on_device: dict[torch.device, tuple[dict[str, torch.Tensor], float]] = {}
        weights: dict[str, torch.Tensor] = {}
        for backend in backends:
            # The weights and the copy baseline on the backend's own device, same run: for
            # cuda_ipc and nccl a device-to-device copy of the same bytes (the device's bound)
            device = device_for(backend, 0)
            if device not in on_device:
                on_device.clear()  # one copy of the weights held at a time
                weights = {}
                weights = allocate(layout, device)
                gen = torch.Generator().manual_seed(1)
                for t in weights.values():
                    t.copy_(torch.randn(t.shape, generator=gen))
                on_device[device] = weights, _plain_copy_seconds(weights, device)
            weights, copy_s = on_device[device]
            plans = [dict(backend=backend, delta=False, changed=None, share=args.share)]
            if args.in_place and backend == "shm":
                plans += [
                    dict(backend=backend, delta=False, changed=None, share=False, in_place=True)
                ]
            if args.delta:
                plans += [
                    dict(backend=backend, delta=True, changed=c, share=False, compress=z)
                    for c in args.changed
                    for z in ("off", *(["zstd"] if args.compress else []))
                ]
            if args.fp8:
                plans += [dict(backend=backend, delta=False, changed=None, share=False, fp8=True)]
                plans += [
                    dict(backend=backend, delta=True, changed=c, share=False, fp8=True)
                    for c in (args.changed if args.delta else [])
                ]
            dense_s = None
            for plan in plans:
                result = _run_row(args, plan, layout, {n: t.clone() for n, t in weights.items()})
                tag = " (zero-copy)" if plan["share"] else ""
                tag += " (in place)" if plan.get("in_place") else ""
                tag += " fp8" if plan.get("fp8") else ""
                tag += " +zstd" if plan.get("compress") == "zstd" else ""
                row = {
                    "backend": backend + tag,
                    "shapes": label,
                    "tensors": len(layout),
                    "receivers": args.receivers,
                    "bucket_size": bucket,
                    "bytes": size,
                    "copy_seconds": copy_s,
                    "copy_device": str(device),
                    **result,
                    "gbps": size / result["seconds"] / 1e9,
                    "ratio_to_copy": copy_s / result["seconds"],
                    "peak_extra_buckets": result["peak_extra"] / bucket,
                }
                if plan["delta"]:
                    row["changed"] = plan["changed"]
                if plan["delta"] or plan.get("fp8"):  # against the bf16 dense row
                    row.update(dense_seconds=dense_s, speedup_vs_dense=dense_s / result["seconds"])
                else:
                    dense_s = result["seconds"]
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
        del weights, on_device
    if not args.json:
        print_table(rows, args)
        print_adapter_ratios(rows)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
