"""Errors raised by checkpoint engines."""

from __future__ import annotations

__all__ = [
    "CheckpointEngineAborted",
    "CheckpointEngineAuthError",
    "CheckpointEngineError",
    "CheckpointEngineTimeout",
]


class CheckpointEngineError(RuntimeError):
    """A weight transfer failed: bad input, corrupted data, or a failed peer."""


class CheckpointEngineTimeout(CheckpointEngineError):
    """A peer did not answer within the engine's ``timeout`` (it stalled or died)."""


class CheckpointEngineAuthError(CheckpointEngineError):
    """A message in the group's store was not signed with the group's secret: a process
    outside the group wrote it. Never a peer's ordinary failure: a caller that tolerates
    those (a re-send after a member died) still stops on this."""


class CheckpointEngineAborted(CheckpointEngineError):
    """The update was ended by :meth:`~rlwire.ckpt_engine.CheckpointEngine.abort` (on this
    member, or on the master for the whole group): nothing of it was applied; the engine
    takes no further update (finalize it and join a new group)."""
