"""What marks a folder as an rlwire export: ``rlwire_export.json``, holding the step its
weights were trained to. In ``hf_model/`` it is written once the export is complete, so that
a run stopped between its last checkpoint and the end of its export is exported again by
the same command rather than left without one (or with an earlier run's). In a folder
``rlwire-train export`` writes (:mod:`.hf_export`) it is there from the moment the folder
appears; ``export --out`` replaces only a folder that is empty or holds it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["EXPORT_MARKER", "export_marker", "exported_step", "marked_step", "mark_exported"]

EXPORT_MARKER = "rlwire_export.json"
"""``{"step": N}`` (an offline export adds the run it came from); Hugging Face, PEFT and vLLM
loaders ignore the file."""


def export_marker(step: int, **more: Any) -> str:
    """The marker's text for an export of ``step`` (``more``: what else it records)."""
    return json.dumps({"step": step, **more}) + "\n"


def marked_step(folder: Path) -> int | None:
    """The step the export in ``folder`` holds, or None when ``folder`` holds no marked,
    complete rlwire export (none written, cut off, written before this marker existed, or
    not an export at all)."""
    try:
        step = json.loads((folder / EXPORT_MARKER).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def exported_step(run_dir: Path) -> int | None:
    """The step ``run_dir/hf_model/`` was exported at (:func:`marked_step`)."""
    return marked_step(run_dir / "hf_model")


def mark_exported(run_dir: Path, step: int) -> None:
    """Record that ``run_dir/hf_model/`` now holds the weights after ``step`` updates (the
    file is replaced whole)."""
    marker = run_dir / "hf_model" / EXPORT_MARKER
    staging = marker.with_name(marker.name + ".tmp")
    staging.write_text(export_marker(step))
    os.replace(staging, marker)
