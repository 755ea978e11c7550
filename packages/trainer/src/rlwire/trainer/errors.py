"""The one error a run stops with: its message is the whole report (no traceback)."""

from __future__ import annotations

__all__ = ["RunError"]


class RunError(RuntimeError):
    """The run cannot start or continue; the message says why (no traceback needed)."""
