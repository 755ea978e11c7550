"""The run's model, validated before anything starts (the data and the reward:
:mod:`rlwire.trainer.data.pipeline`; the checkpoint folders:
:mod:`rlwire.trainer.outputs.checkpoint_dirs`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RunError
from ..models.hub import snapshot
from .readers import is_hub_id
from .tasks import BUILTIN_TASKS, Task, builtin_task

if TYPE_CHECKING:
    from ..config.root import TrainerConfig

__all__ = ["build_tiny", "reads_rows", "resolve_model"]


def tiny_task(config: TrainerConfig) -> Task:
    """The task whose tiny model ``model.path=tiny`` builds: the built-in task trained, else
    the default one's."""
    return builtin_task(config.data.source) or BUILTIN_TASKS["repeat"]


def build_tiny(config: TrainerConfig, directory: Path) -> Path:
    """Build (once) ``model.path=tiny``'s model for the run's task at ``directory``."""
    return tiny_task(config).build_model(directory, seed=config.trainer.seed)


def reads_rows(config: TrainerConfig, rows_given: bool) -> bool:
    """Whether the run reads rows (a file, a dataset, or ``rows_given`` by the Python API)
    before its workers start: their chat prompts are rendered and their lengths measured
    with the model's tokenizer then, so the tiny model must exist by then. A built-in
    task's prompts are generated: its tiny model can wait for actor rank 0."""
    validation = config.validation.source
    return (
        rows_given
        or builtin_task(config.data.source) is None
        or (validation is not None and builtin_task(validation) is None)
    )


def resolve_model(config: TrainerConfig, run_dir: Path, *, build: bool = True) -> Path:
    """The model directory: the built-in tiny model (built once, unless ``build`` is false:
    then only its place), the user's, or a Hub id's snapshot (downloaded once)."""
    if config.model.path == "tiny":
        # One directory per seed: a new trainer.seed on an old run directory gets its model.
        seed = config.trainer.seed
        directory = run_dir / f"{tiny_task(config).model_name}-seed{seed}"
        return build_tiny(config, directory) if build else directory
    path = Path(config.model.path).expanduser().resolve()
    if not path.exists() and is_hub_id(config.model.path):
        path = snapshot(config.model.path, "model.path")
    if not (path / "config.json").is_file():
        raise RunError(
            f"model.path: {path} is not a Hugging Face model directory "
            "(no config.json there); give a local directory, a Hub id (org/name) or 'tiny'"
        )
    return path
