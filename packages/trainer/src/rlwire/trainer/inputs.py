"""The run's model and checkpoints, validated before anything starts (the data and the
reward: :mod:`rlwire.trainer.data`, :mod:`rlwire.trainer.rewards`)."""

from __future__ import annotations

import re
from pathlib import Path

from .config import TrainerConfig
from .errors import RunError

__all__ = ["checkpoint_step", "latest_checkpoint", "resolve_model"]


def resolve_model(config: TrainerConfig, run_dir: Path, *, build: bool = True) -> Path:
    """The model directory: the built-in tiny model (built once, unless ``build`` is false:
    then only its place) or the user's."""
    if config.model.path == "tiny":
        from .tiny import build_tiny_model

        # One directory per seed: a new trainer.seed on an old run directory gets its model.
        seed = config.trainer.seed
        directory = run_dir / f"tiny-model-seed{seed}"
        return build_tiny_model(directory, seed=seed) if build else directory
    path = Path(config.model.path).resolve()
    if not (path / "config.json").is_file():
        raise RunError(
            f"model.path: {path} is not a Hugging Face model directory "
            "(no config.json there); give a local directory or 'tiny'"
        )
    return path


_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            if (m := _STEP_DIR.match(child.name)) and (child / "COMPLETE").exists():
                found.append((int(m[1]), child))
    return max(found)[1] if found else None


def checkpoint_step(checkpoint: Path) -> int:
    """The step a ``checkpoints/step_<n>`` directory was saved at."""
    return int(_STEP_DIR.match(checkpoint.name)[1])
