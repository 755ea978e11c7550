"""A run directory's checkpoint folders (``checkpoints/step_<n>``, complete once their
``COMPLETE`` marker is there): the newest complete one, pruning, and setting an earlier
run's aside. What a checkpoint holds: :mod:`.checkpoint`."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

__all__ = [
    "checkpoint_step",
    "completed_step",
    "latest_checkpoint",
    "prune_checkpoints",
    "set_aside_checkpoints",
]

log = logging.getLogger("rlwire.trainer")

_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.partial$")  # a save being written (or cut off)


def _checkpoints(run_dir: Path) -> list[tuple[int, bool, Path]]:
    """``(step, complete, directory)`` of every ``checkpoints/step_<n>``, and of every save
    being written or cut off (``step_<n>.partial``, never complete: it becomes ``step_<n>``
    once it is), oldest first."""
    root = run_dir / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            if m := _STEP_DIR.match(child.name):
                found.append((int(m[1]), (child / "COMPLETE").exists(), child))
            elif m := _PARTIAL_DIR.match(child.name):
                found.append((int(m[1]), False, child))
    return sorted(found)


def set_aside_checkpoints(run_dir: Path, after: int | None = None) -> Path | None:
    """Move an earlier run's checkpoints out of the way and return where: all of them
    (``trainer.resume=never``), or with ``after`` those of steps after it (a
    ``trainer.resume=PATH`` of that step: the branch abandoned), into
    ``checkpoints.before-<n>/`` (the first free ``n``), so that the new run's pruning, and a
    later ``resume=auto``, see the new run's checkpoints only (left in place, the earlier
    run's higher steps would count as the newest: pruning would remove each new checkpoint
    as it is saved). None: nothing to move."""
    moved = [path for step, _, path in _checkpoints(run_dir) if after is None or step > after]
    if not moved:
        return None
    number = 1
    while (run_dir / f"checkpoints.before-{number}").exists():
        number += 1
    target = run_dir / f"checkpoints.before-{number}"
    if after is None:
        (run_dir / "checkpoints").rename(target)
        return target
    target.mkdir()
    for path in moved:
        path.rename(target / path.name)
    return target


def latest_checkpoint(run_dir: Path) -> Path | None:
    complete = [path for _, done, path in _checkpoints(run_dir) if done]
    return complete[-1] if complete else None


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints, and unfinished ones older
    than the newest complete one (a save that was cut off); what was removed. A checkpoint
    is removed only when ``keep`` newer complete ones exist, so a crash in the middle of a
    save or of this pruning leaves the last complete checkpoint in place (``COMPLETE`` goes
    first: a half-removed directory is an unfinished one). Only ``checkpoints/`` is pruned:
    the lineage being continued (a resume sets every other aside, into
    ``checkpoints.before-<n>/``, which nothing removes). A folder that cannot be removed is
    left, with one warning naming it: pruning runs after a complete save and never ends
    the run (the next pruning tries it again)."""
    found = _checkpoints(run_dir)
    complete = [path for _, done, path in found if done]
    if not complete:
        return []
    newest = checkpoint_step(complete[-1])
    doomed = complete[:-keep] + [p for step, done, p in found if not done and step < newest]
    removed = []
    for path in doomed:
        try:
            (path / "COMPLETE").unlink(missing_ok=True)
            shutil.rmtree(path)
        except OSError as err:
            log.warning("pruning checkpoints: %s not removed (%s); the run goes on", path, err)
            continue
        removed.append(path)
    return removed


def completed_step(checkpoint: Path) -> int | None:
    """The step a complete checkpoint's ``COMPLETE`` marker records (any directory name);
    None when it records none."""
    try:
        text = (checkpoint / "COMPLETE").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def checkpoint_step(checkpoint: Path) -> int:
    """The step a ``checkpoints/step_<n>`` directory was saved at."""
    match = _STEP_DIR.match(checkpoint.name)
    assert match is not None, f"{checkpoint}: not a step_<n> directory"
    return int(match[1])
