"""What ``hf_model/`` holds: the step its weights were trained to, written once the export is
complete (``hf_model/rlwire_export.json``), so that a run stopped between its last checkpoint
and the end of its export is exported again by the same command rather than left without one
(or with an earlier run's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["EXPORT_MARKER", "exported_step", "mark_exported"]

EXPORT_MARKER = "rlwire_export.json"
"""In ``hf_model/``: ``{"step": N}``; Hugging Face and vLLM loaders ignore the file."""


def exported_step(run_dir: Path) -> int | None:
    """The step ``run_dir/hf_model/`` was exported at, or None when no complete export is
    marked there (none written, cut off, or written before this marker existed)."""
    try:
        step = json.loads((run_dir / "hf_model" / EXPORT_MARKER).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def mark_exported(run_dir: Path, step: int) -> None:
    """Record that ``run_dir/hf_model/`` now holds the weights after ``step`` updates (the
    file is replaced whole)."""
    marker = run_dir / "hf_model" / EXPORT_MARKER
    staging = marker.with_name(marker.name + ".tmp")
    staging.write_text(json.dumps({"step": step}) + "\n")
    os.replace(staging, marker)
