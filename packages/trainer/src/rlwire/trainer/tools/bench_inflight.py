"""``python -m rlwire.trainer.bench --in-flight 1,2,4,...``: one rollout engine's samples/s
against the number of conversations it keeps in flight, on the ``lookup`` task.

One process, no Ray: the ``hf`` engine on the lookup task's primed model (``--seeds``'s
first seed), the agent loop running ``--conversations`` conversations (2 per prompt) with
at most ``C`` in
flight at once and the engine decoding at most ``C`` requests together
(``rollout.max_num_seqs``), for each ``C``; the tool is ``agent.tools``'s (default the
lookup tool that waits 50 ms without using the CPU, ``remote_lookup:lookup``). Prints per
``C``: samples/s, the ratio to ``C = 1`` measured in the same run, the engine's own seconds
(the sum of its decoding steps) and the bound they allow (conversations over the engine's
seconds: what samples/s would be if no conversation ever waited for a tool with the engine
idle), with the measured share of it; writes the plot ``inflight.png`` next to the table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

__all__ = ["inflight_bench"]

DEFAULT_TOOL = "rlwire.trainer.agent.remote_lookup:lookup"


def _measure(path: Path, overrides: list[str], count: int, seed: int, width: int) -> dict:
    import asyncio

    import torch

    from ..agent.loop import build_loop
    from ..config.root import load_config
    from ..data.tasks import BUILTIN_TASKS
    from ..rollout.hf import HFEngine

    config = load_config(
        overrides=[
            "data.source=builtin:lookup",
            f"agent.tools=[{DEFAULT_TOOL}]",
            "rollout.n=2",
            *overrides,
            f"rollout.max_num_seqs={width}",
        ]
    )
    engine = HFEngine(config, str(path), torch.device("cpu"))
    loop = build_loop(config, engine, str(path))
    examples = BUILTIN_TASKS["lookup"].examples(count // 2, seed + 1000, "builtin:lookup")
    began = time.perf_counter()
    out = asyncio.run(loop.run_async(examples, 2, seed, max_in_flight=width))
    wall = time.perf_counter() - began
    core = engine.core
    assert core is not None  # the hf engine's own
    core.close()
    calls = sum(len(t.tool_results) for t in out.trajectories or [])
    return {
        "width": width,
        "samples_s": len(out) / wall,
        "engine_s": core.busy_s,
        "wall_s": wall,
        "calls": calls / len(out),
    }


def inflight_bench(args: argparse.Namespace, root: Path) -> int:
    """The ``--in-flight`` table and plot (see the module docstring)."""
    import torch

    from ..agent.lookup import build_lookup_model

    torch.set_num_threads(args.threads)
    seed = int(args.seeds.split(",")[0])
    path = build_lookup_model(root / f"lookup-model-seed{seed}", seed=seed)
    widths = [int(w) for w in args.in_flight.split(",")]
    print(
        f"one hf engine, lookup task (model seed {seed}), {args.conversations} conversations, "
        f"torch threads {args.threads}, overrides {args.overrides}"
    )
    print("| in flight | samples/s | vs 1 | engine s | bound samples/s | of bound | tool calls |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for width in widths:
        row = _measure(path, args.overrides, args.conversations, seed, width)
        rows.append(row)
        bound = args.conversations / row["engine_s"]
        print(
            f"| {width} | {row['samples_s']:.1f} | {row['samples_s'] / rows[0]['samples_s']:.2f}x "
            f"| {row['engine_s']:.2f} | {bound:.1f} | {row['samples_s'] / bound:.2f} "
            f"| {row['calls']:.2f} |"
        )
    plot = root / "inflight.png"
    _plot(rows, plot)
    print(f"plot: {plot}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    widths = [r["width"] for r in rows]
    ax.plot(widths, [r["samples_s"] for r in rows], "o-", label="measured")
    bound = [r["wall_s"] * r["samples_s"] / r["engine_s"] for r in rows]
    ax.plot(widths, bound, "--", color="grey", label="engine's bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("conversations in flight (rollout.max_num_seqs)")
    ax.set_ylabel("samples/s")
    ax.set_title("one hf engine, lookup task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
