"""Errors raised by checkpoint engines."""

from __future__ import annotations

__all__ = ["CheckpointEngineError", "CheckpointEngineTimeout"]


class CheckpointEngineError(RuntimeError):
    """A weight transfer failed: bad input, corrupted data, or a failed peer."""


class CheckpointEngineTimeout(CheckpointEngineError):
    """A peer did not answer within the engine's ``timeout`` (it stalled or died)."""
