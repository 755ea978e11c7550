"""The one error a run stops with: its message is the whole report (no traceback)."""

from __future__ import annotations

__all__ = ["AlreadyFinished", "RunError"]


class RunError(RuntimeError):
    """The run cannot start or continue; the message says why (no traceback needed)."""


class AlreadyFinished(RunError):
    """``trainer.resume=auto`` found a run that already reached ``trainer.steps``: nothing
    to do. The command says so in one line and exits 0 before starting anything."""
