from __future__ import annotations

import pytest

from rlwire.grad_sync._launch import spawn as _spawn


@pytest.fixture
def spawn():
    """Run ``fn(rank, world_size, *args)`` on fresh gloo ranks; returns per-rank results."""
    return _spawn
