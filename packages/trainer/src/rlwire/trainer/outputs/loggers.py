"""Where each step's metrics go besides ``metrics.jsonl`` (always written: the plot, the bench
and resumed runs read it): ``trainer.logger``, verl's key, lists ``console``, ``jsonl``,
``tensorboard`` and ``wandb``.

- ``console``: one line per step on the terminal (above the progress bar);
- ``jsonl``: ``metrics.jsonl`` (always on; accepted so that verl configs naming it work);
- ``tensorboard``: event files under ``<run dir>/tensorboard`` (extra
  ``rlwire-trainer[tensorboard]``);
- ``wandb``: a Weights & Biases run (extra ``rlwire-trainer[wandb]``) in the run directory,
  online with the login the user has (``WANDB_API_KEY``, or the key ``wandb login`` wrote
  to ``~/.netrc``), offline (said in one line; ``wandb sync`` uploads it later) without
  one, or as ``WANDB_MODE`` says.

Each step's line carries verl's and TRL's names for the metrics they share
(:mod:`.metric_names`), so every logger gets them too.

Only numbers are logged to the trackers; the run's whole record stays in ``metrics.jsonl``.
"""

from __future__ import annotations

import abc
import contextlib
import netrc
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..errors import RunError

__all__ = ["LOGGERS", "Tracker", "open_trackers", "wandb_mode"]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
_CONSOLE_KEYS = (
    "reward_mean",
    "policy_loss",
    "grad_norm",
    "response_length",
    "samples_per_s",
    "val/reward_mean",
)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class Tracker(abc.ABC):
    @abc.abstractmethod
    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One step's metrics (the ``metrics.jsonl`` line)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release (called once at the end of the run)."""


class _Console(Tracker):
    def log(self, metrics: dict[str, Any], step: int) -> None:
        from tqdm import tqdm

        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in _CONSOLE_KEYS if k in metrics)
        tqdm.write(f"step {step}: {shown}")

    def close(self) -> None:
        sys.stdout.flush()


class _TensorBoard(Tracker):
    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RunError(
                "trainer.logger: tensorboard needs the tensorboard package: "
                "pip install 'rlwire-trainer[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB(Tracker):
    def __init__(self, run_dir: Path, config: Any, settings: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise RunError(
                "trainer.logger: wandb needs the wandb package: pip install 'rlwire-trainer[wandb]'"
            ) from None
        mode, note = wandb_mode(os.environ, run_dir)
        if note is not None:
            print(f"rlwire-train: {note}", file=sys.stderr)
        section = config.trainer
        self.run = wandb.init(
            project=section.project_name,
            name=section.experiment_name or run_dir.name,
            dir=str(run_dir),
            mode=mode,  # type: ignore[arg-type]  # WANDB_MODE as set: wandb checks it
            config=settings,
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_mode(environ: Any, run_dir: Path) -> tuple[str, str | None]:
    """The mode a wandb run starts in: ``WANDB_MODE`` when set, else ``online`` with a login
    (``WANDB_API_KEY``, or an entry for the wandb host, ``WANDB_BASE_URL``'s or
    ``api.wandb.ai``, in the netrc file ``wandb login`` writes: ``NETRC`` or ``~/.netrc``),
    else ``offline``, with the line that says so (None when not offline for want of one)."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"], None
    if environ.get("WANDB_API_KEY"):
        return "online", None
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    file = environ.get("NETRC") or str(Path(environ.get("HOME") or Path.home()) / ".netrc")
    with contextlib.suppress(OSError, netrc.NetrcParseError):  # none, or one wandb cannot read
        if netrc.netrc(file).authenticators(host) is not None:
            return "online", None
    return "offline", (
        f"trainer.logger=wandb: no wandb login ({host} in {file}, or WANDB_API_KEY): "
        f"logging offline to {run_dir / 'wandb'}; upload it with `wandb sync`, or run "
        "`wandb login` first"
    )


def open_trackers(config: Any, run_dir: Path, settings: dict[str, Any]) -> list[Tracker]:
    """The trackers ``trainer.logger`` names (``settings``: the resolved config, for wandb)."""
    chosen = config.trainer.logger
    trackers: list[Tracker] = []
    if "console" in chosen:
        trackers.append(_Console())
    if "tensorboard" in chosen:
        trackers.append(_TensorBoard(run_dir))
    if "wandb" in chosen:
        trackers.append(_WandB(run_dir, config, settings))
    return trackers
