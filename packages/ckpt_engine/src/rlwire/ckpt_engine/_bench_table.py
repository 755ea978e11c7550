"""The tables ``python -m rlwire.ckpt_engine.bench`` prints from its rows (one dict each)."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

__all__ = ["print_adapter_ratios", "print_table"]


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Every row as a Markdown table, under a line naming the run's setting."""
    print(
        f"{args.receivers} receivers, bucket {args.bucket_size}, torch threads: "
        f"{args.sender_threads or args.threads} sender, {args.threads} per receiver; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(
        "| backend | shapes | GiB | changed | wire MB | end-to-end s | GB/s | plain copy s | "
        "ratio to copy | vs dense | overlap | peak extra (buckets) | bit-identical |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        changed = f"{r['changed']:g}" if "changed" in r else "dense"
        versus = f"{r['speedup_vs_dense']:.2f}x" if "speedup_vs_dense" in r else ""
        print(
            f"| {r['backend']} | {r['shapes']} | {r['bytes'] / 2**30:.2f} | {changed} "
            f"| {r['wire_bytes'] / 1e6:.1f} ({100 * r['wire_bytes'] / r['bytes']:.2f}%) "
            f"| {r['seconds']:.3f} | {r['gbps']:.2f} "
            f"| {r['copy_seconds']:.3f} | {r['ratio_to_copy']:.2f} | {versus} "
            f"| {r['overlap']:.2f} | {r['peak_extra_buckets']:.2f} "
            f"| {'yes' if r['bit_identical'] else 'NO'} |"
        )


def print_adapter_ratios(rows: list[dict[str, Any]]) -> None:
    """Each adapter row's bytes and seconds over its dense layout's, per backend."""
    dense = {(r["backend"], r["shapes"]): r for r in rows if "changed" not in r}
    for r in rows:
        base = r["shapes"].split(" LoRA r")[0]
        if base == r["shapes"] or "changed" in r or (r["backend"], base) not in dense:
            continue
        d = dense[(r["backend"], base)]
        print(
            f"{r['backend']}: {r['shapes']} adapter {r['bytes'] / 1e6:.1f} MB = "
            f"{r['bytes'] / d['bytes']:.2%} of the dense weights' bytes; one sync "
            f"{r['seconds'] * 1e3:.1f} ms = {r['seconds'] / d['seconds']:.3f}x the dense sync"
        )
