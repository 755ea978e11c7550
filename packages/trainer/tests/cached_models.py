"""The primed ``lookup`` model, built once per machine and kept in the user's cache folder
(beside uv's and mypy's): priming takes 16-40 s of CPU, and three test files use it.

The entry is keyed by the sources that build it (``agent/lookup.py``, ``models/tiny.py``), the
torch and transformers versions and the seed: a change to any of them builds a new one. It
is built in a temporary folder and renamed into place, so a reader never sees half of one
(two processes building the same entry at once: the second rename fails, the first one's
is taken)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def cached_lookup_model(seed: int) -> Path:
    """The lookup task's model for ``seed`` (``build_lookup_model``), from the cache."""
    import torch
    import transformers

    from rlwire.trainer.agent import lookup
    from rlwire.trainer.models import tiny

    digest = hashlib.sha256()
    for module in (lookup, tiny):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(f"{torch.__version__} {transformers.__version__} {seed}".encode())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlwire-tests"
    target = root / f"lookup-seed{seed}-{digest.hexdigest()[:16]}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        lookup.build_lookup_model(building / "model", seed=seed)
        try:
            os.rename(building / "model", target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target
