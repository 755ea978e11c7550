"""Benchmark: offload/load bandwidth against the pageable baseline and a raw pinned copy.

    python -m rlwire.offload.bench [--gib 4] [--cycles 3]

On a CUDA machine it builds a model of ``--gib`` GiB (bf16 parameters) and
prints, from one run, D2H and H2D GB/s for: the synchronous pageable baseline
(``model.cpu()`` / ``model.to(device)``), ``non_blocking`` copies into freshly
allocated pinned memory, this package's pooled path on its first cycle with a
fresh pool (page-locking its chunks on the way) and with the pool prepared ahead
(``prepare_model``, waited for before the clock starts; its own time is printed
below the table), on later cycles, and a raw pinned ``copy_`` of the same bytes
(the link's practical limit), each with its ratio to that limit and to the
pageable baseline. All times are wall clock from the call to completion
(``torch.cuda.synchronize``). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from ._offload import load_model, offload_model
from ._pool import PinnedPool, _empty_host_cache
from ._prepare import prepare_model

_CHUNK = 64 << 20  # elements per parameter tensor (128 MiB in bf16)


def _model(gib: float, device: torch.device) -> nn.Module:
    total = int(gib * (1 << 30)) // 2
    sizes = [_CHUNK] * (total // _CHUNK) + ([total % _CHUNK] if total % _CHUNK else [])
    return nn.ParameterList(
        nn.Parameter(torch.randn(n, device=device, dtype=torch.bfloat16), requires_grad=False)
        for n in sizes
    )


def _timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _raw_limit(nbytes: int, device: torch.device) -> tuple[float, float]:
    """D2H and H2D seconds of one pinned ``copy_`` of ``nbytes``: the link's practical limit."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    _timed(lambda: host.copy_(dev, non_blocking=True))  # warm-up
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True))
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True))
    return d2h, h2d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--cycles", type=int, default=3, help="later cycles (median reported)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("rlwire.offload.bench: no CUDA device on this machine; nothing to measure")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(args.gib, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows: dict[str, tuple[float, float]] = {}

    rows["raw pinned copy_ (limit)"] = _raw_limit(nbytes, device)
    _empty_host_cache()  # else the next paths get the limit's pinned block back from the cache

    # Synchronous pageable baseline.
    d2h = _timed(lambda: model.cpu())
    h2d = _timed(lambda: model.to(device))
    rows["pageable model.cpu() / .to(device)"] = (d2h, h2d)

    # non_blocking into freshly pinned memory each time.
    params = list(model.parameters())
    fresh: list[torch.Tensor] = []

    def fresh_d2h() -> None:
        for p in params:
            t = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            t.copy_(p.data, non_blocking=True)
            fresh.append(t)
        torch.cuda.synchronize()
        for p, t in zip(params, fresh, strict=True):
            p.data = t

    def fresh_h2d() -> None:
        for p in params:
            p.data = p.data.to(device, non_blocking=True)

    rows["non_blocking, fresh pinned memory"] = (_timed(fresh_d2h), _timed(fresh_h2d))
    fresh.clear()
    _empty_host_cache()  # the pool's first cycle really pins

    cold = PinnedPool()
    d2h = _timed(lambda: offload_model(model, pool=cold).wait())
    h2d = _timed(lambda: load_model(model).wait())
    rows["rlwire.offload, first cycle, fresh pool (pins chunks on the way)"] = (d2h, h2d)
    cold.release()  # unpins: the next pool starts from nothing again

    pool = PinnedPool()
    began = time.perf_counter()
    preparation = prepare_model(model, pool=pool).wait()
    prepare_s = time.perf_counter() - began
    d2h = _timed(lambda: offload_model(model, pool=pool).wait())
    h2d = _timed(lambda: load_model(model).wait())
    rows["rlwire.offload, first cycle, pool prepared ahead"] = (d2h, h2d)
    later = [
        (
            _timed(lambda: offload_model(model, pool=pool).wait()),
            _timed(lambda: load_model(model).wait()),
        )
        for _ in range(args.cycles)
    ]
    rows[f"rlwire.offload, later cycles (median of {args.cycles})"] = (
        statistics.median(d for d, _ in later),
        statistics.median(h for _, h in later),
    )
    stats = pool.stats()
    # What another process could allocate: reserved memory with and without empty_cache.
    memory = {}
    for empty_cache in (False, True):
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        offload_model(model, pool=pool, empty_cache=empty_cache).wait()
        memory[empty_cache] = (before, torch.cuda.memory_reserved(device))
        load_model(model).wait()

    gb = nbytes / 1e9
    limit_d2h, limit_h2d = rows["raw pinned copy_ (limit)"]
    base_d2h, base_h2d = rows["pageable model.cpu() / .to(device)"]
    print(
        f"GPU {torch.cuda.get_device_name(device)}, {datetime.date.today()}, "
        f"{nbytes / 2**30:.2f} GiB of bf16 parameters "
        f"in {len(params)} tensors, torch {torch.__version__}"
    )
    header = (
        "| path | D2H GB/s | D2H / limit | D2H / pageable | H2D GB/s | H2D / limit "
        "| H2D / pageable |"
    )
    print(header)
    print("|---|" + "---:|" * 6)
    for name, (d2h, h2d) in rows.items():
        print(
            f"| {name} | {gb / d2h:.1f} | {limit_d2h / d2h:.2f} | {base_d2h / d2h:.2f} "
            f"| {gb / h2d:.1f} | {limit_h2d / h2d:.2f} | {base_h2d / h2d:.2f} |"
        )
    lock_gbps = preparation.nbytes / prepare_s / 1e9
    print(
        f"prepare_model (off the critical path, on a background thread): "
        f"{preparation.nbytes / 2**30:.2f} GiB in {len(preparation.sizes)} buffers of at most "
        f"{pool.chunk_bytes >> 20} MiB, {prepare_s:.2f} s ({lock_gbps:.1f} GB/s page-locking)"
    )
    print(f"pool after {args.cycles + 1} cycles: {stats}")
    for empty_cache, (before, after) in memory.items():
        print(
            f"device memory reserved by this process, offload_model(empty_cache={empty_cache}): "
            f"{before / 2**30:.2f} GiB before, {after / 2**30:.2f} GiB after"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
