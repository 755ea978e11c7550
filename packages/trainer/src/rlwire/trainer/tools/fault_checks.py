"""The fault campaign's checks (:mod:`rlwire.trainer.tools.faults`) as pure functions of what a run
left: its metrics records, its trained prompts, its checkpoints' bytes, the names in
``/dev/shm``. No Ray, no torch: the unit tests build their inputs by hand."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "SHM_PREFIX",
    "accounting",
    "damaged_files",
    "digest_checkpoint",
    "indices_from_prompts",
    "prompt_mismatches",
    "shm_leftovers",
    "step_records",
    "summary_table",
    "versions_back",
]

SHM_PREFIX = "rlwire-ckpt-shm-"
"""``rlwire.ckpt_engine``'s shm segment names: this, the creating process's pid, ``-``
(a test checks it is the engine's own constant)."""


def step_records(path: Path) -> list[dict[str, Any]]:
    """The step lines of a ``metrics.jsonl`` (validation lines, which carry no
    ``weight_version``, left out), in file order."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "weight_version" in r]


def accounting(
    trained: list[tuple[int, list[int]]],
    *,
    steps: int,
    batch_size: int,
    pending: Iterable[int] = (),
    started: int | None = None,
) -> dict[str, int]:
    """Prompt groups lost or trained twice over a whole (resumed) run.

    ``trained``: each step line's step and the data positions of the groups it trained
    (``group_indices``), in file order.
    One-step off-policy (``started`` None): steps ``1..steps`` must have trained positions
    ``0 .. steps x batch_size - 1`` once each. Fully async: every position the stream
    started (``started``: the final checkpoint's ``next_group``) was trained once, or is
    ``pending`` there (to be generated again on a resume: trained once if ever). A group
    dropped for its lag is not a loss of its own: its position goes back to be generated
    again first (the queue's ``redo``), so it is trained later or pending (subtracting the
    steps' ``dropped_samples`` counted such positions twice: a campaign trial whose last
    step dropped 8 lagging groups, pending in the checkpoint, showed -8 lost).

    Returns ``lost`` (positions neither trained nor pending; for fully async a count,
    negative when more groups are accounted for than started), ``repeated``
    (extra trainings of a position, and pending positions already trained), ``missing_steps``
    and ``extra_steps`` (step numbers absent, or present more than once or past ``steps``).
    """
    counts = Counter(i for _, groups in trained for i in groups)
    pending = set(pending)
    repeated = sum(c - 1 for c in counts.values()) + len(pending & counts.keys())
    if started is None:
        lost = len(set(range(steps * batch_size)) - counts.keys())
    else:
        lost = started - len(counts.keys() | pending)
    present = Counter(step for step, _ in trained)
    return {
        "lost": lost,
        "repeated": repeated,
        "missing_steps": sum(1 for s in range(1, steps + 1) if s not in present),
        "extra_steps": sum(c - 1 for c in present.values()) + sum(1 for s in present if s > steps),
    }


def indices_from_prompts(
    prompts: list[tuple[int, list[str]]], batch: Callable[[int], list[str]], batches: int
) -> list[tuple[int, list[int]]]:
    """One-step off-policy records no group positions: a step's trained prompts (each step
    line's step and prompts, in file order), matched to
    the data's batches ``0 .. batches - 1`` (``batch(b)``: batch b's prompts in order), give
    them (``b x batch_size + i``). A step that matches no batch trained something that is
    not the data's: it gets no positions (its groups count as lost)."""
    known = {tuple(batch(b)): b for b in range(batches)}
    found = []
    for step, texts in prompts:
        b = known.get(tuple(texts))
        found.append((step, [] if b is None else [b * len(texts) + i for i in range(len(texts))]))
    return found


def prompt_mismatches(
    trained: list[tuple[int, list[int]]],
    prompts: Mapping[int, list[str]],
    prompt_at: Callable[[int], str],
) -> int:
    """Groups whose trained prompt is not the data's prompt at the position recorded for it
    (fully async: ``group_indices`` against ``rollout_data_dir``); a step whose prompts were
    not written counts all its groups."""
    wrong = 0
    for step, indices in trained:
        texts = prompts.get(step, [])
        if len(texts) != len(indices):
            wrong += len(indices)
            continue
        wrong += sum(text != prompt_at(i) for i, text in zip(indices, texts, strict=True))
    return wrong


def versions_back(records: list[dict[str, Any]]) -> int:
    """Steps whose ``weight_version`` is below the previous step's, or above the step (the
    weights after ``step`` updates are version ``step`` at most)."""
    back, previous = 0, -1
    for record in records:
        version = record["weight_version"]
        back += version < previous or version > record["step"]
        previous = max(previous, version)
    return back


def digest_checkpoint(directory: Path) -> dict[str, str]:
    """sha256 of every file under a checkpoint directory, by path relative to it."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def damaged_files(
    recorded: Mapping[str, Mapping[str, str]], checkpoints: Path
) -> tuple[list[str], list[str]]:
    """Complete checkpoints digested earlier (``recorded``: ``step_N`` -> file -> sha256),
    compared with ``checkpoints`` now. Returns (files changed or missing in a checkpoint
    still there, checkpoints gone: removed by the retention policy, which is fine)."""
    damaged, gone = [], []
    for name, files in recorded.items():
        directory = checkpoints / name
        if not directory.exists():
            gone.append(name)
            continue
        for rel, digest in files.items():
            path = directory / rel
            now = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
            if now != digest:
                damaged.append(f"{name}/{rel}")
    return damaged, gone


def shm_leftovers(names: Iterable[str], pids: set[int]) -> list[str]:
    """The ckpt engine's segments (:data:`SHM_PREFIX`) made by one of ``pids``."""
    left = []
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        pid = name[len(SHM_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) in pids:
            left.append(name)
    return left


_COLUMNS: dict[str, Callable[[list[dict[str, Any]]], str]] = {
    "trials": lambda g: str(len(g)),
    "landed": lambda g: str(sum(t["landed"] for t in g)),
    "completed": lambda g: str(sum(t["completed"] for t in g)),
    "no restart": lambda g: str(sum(t["completed"] and t["rc1"] == 0 for t in g)),
    "after restart": lambda g: str(sum(t["completed"] and t["rc1"] != 0 for t in g)),
    "lost": lambda g: str(sum(abs(t["lost"]) for t in g if t["completed"])),
    "repeated": lambda g: str(sum(t["repeated"] for t in g if t["completed"])),
    "versions back": lambda g: str(sum(t["versions_back"] for t in g)),
    "leftovers": lambda g: str(sum(t["shm_leftovers"] + t["process_leftovers"] for t in g)),
    "ckpt damaged": lambda g: str(sum(len(t["damaged"]) for t in g)),
    "same model": lambda g: _same_model(g),
    "clean stop": lambda g: str(sum(t["clean_stop"] for t in g)),
    "failed": lambda g: str(sum(bool(t["failed"]) for t in g)),
    "s/trial": lambda g: f"{sum(t['seconds'] for t in g) / len(g):.0f}",
}


def _same_model(group: list[dict[str, Any]]) -> str:
    """``same/compared``, a ``*`` when exactness was not expected of a differing one (fully
    async, or a healed worker with no survivor)."""
    compared = [t for t in group if t.get("same_model") is not None]
    if not compared:
        return "-"
    same = sum(t["same_model"] for t in compared)
    loose = any(not t["same_model"] and not t["exact_expected"] for t in compared)
    return f"{same}/{len(compared)}" + ("*" if loose else "")


def summary_table(trials: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per (mode, fault, phase): the trials; those whose fault
    landed (a kill: in the phase); those whose second run completed, and of them those whose
    first run completed by itself (a rollout worker healed, or killed after it was needed:
    no restart) and those the second run completed (after restart); prompt groups lost and
    trained twice (over completed runs); steps whose weight version went back; leftovers
    (shm segments and processes, both runs); checkpoint files changed; first runs that
    stopped with one line (a SIGKILLed driver's always counts); completed trials whose
    final model and optimizer state equal their reference's bit for bit, of those compared
    (the unfaulted run's, or after a restart that resumed from ``step_K``, that of the
    unfaulted run stopped after ``step_K`` and resumed; ``*``: a difference where none was
    expected to be exact: fully async, a healed worker with no survivor); trials that
    failed any check;
    the mean seconds a trial took. The fault is the target and the signal it got."""
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for t in trials:
        fault = f"{t['target']} {t.get('signal', '')}".strip()
        rows.setdefault((t["mode"], fault, t["phase"]), []).append(t)
    head = ["mode", "fault", "phase", *_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(rows):
        cells = [cell(rows[key]) for cell in _COLUMNS.values()]
        lines.append("| " + " | ".join([*key, *cells]) + " |")
    return "\n".join(lines) + "\n"
