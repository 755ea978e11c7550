"""An agent whose every session fails leaves a step with no token to train on: the step is
skipped and counted, never a traceback, and ``agent.max_failed_steps`` of them in a row stop
the run in one line naming the agent and its last error."""

from __future__ import annotations

import types

import pytest
import torch

from rlwire.trainer.agent.trajectory import Trajectory
from rlwire.trainer.algorithms.scoring import Scored
from rlwire.trainer.config.root import load_config
from rlwire.trainer.errors import RunError
from rlwire.trainer.rollout import Example, Rollout
from rlwire.trainer.runtime.skipped_steps import SkippedSteps


def _failed_batch(rows: int = 4) -> Rollout:
    """What a step of failed sessions gives: prompts, and responses of no token."""
    ids = torch.arange(rows * 3).reshape(rows, 3)
    empty = torch.zeros((rows, 0), dtype=torch.int64)
    batch = Rollout(
        ids,
        torch.ones_like(ids),
        empty,
        empty.clone(),
        torch.zeros((rows, 0)),
        [""] * rows,
        pad_id=0,
        versions=empty.clone(),
        examples=[Example(f"p{i}", "") for i in range(rows)],
    )
    batch.trajectories = [
        Trajectory(rewards=[0.0], error=f"raised ValueError: broken {i}") for i in range(rows)
    ]
    return batch


def test_a_step_of_failed_sessions_is_skipped_then_the_run_stops_naming_the_agent():
    batch = _failed_batch()
    assert batch.version_spans().tolist() == [0, 0, 0, 0]  # was an IndexError
    config = load_config(overrides=["agent.max_failed_steps=2"])
    config.agent.function = "my_agents:solve"  # as set at load (the function's check aside)
    skip = SkippedSteps(config.agent).skip  # what Job.start_update calls for such a batch
    scored = Scored(torch.zeros(4), {}, 0.01)
    metrics = skip(batch, scored)
    assert metrics.update_skipped is True and metrics.optimizer_steps == 0
    assert (metrics.tokens, metrics.reward_mean, metrics.version_span_max) == (0, 0.0, 0)
    with pytest.raises(RunError) as err:
        skip(batch, scored)
    assert str(err.value) == (
        "agent.function 'my_agents:solve': every session failed in 2 steps in a row "
        "(agent.max_failed_steps); the last: raised ValueError: broken 3"
    )


def test_a_resend_after_a_dead_member_stops_on_a_strangers_message():
    """resend_push tolerates the failure of the send it replaces (a member died) but not an
    authentication failure: a stranger wrote to the group's store."""
    from rlwire.ckpt_engine import CheckpointEngineAuthError, CheckpointEngineError
    from rlwire.trainer.runtime.weight_push import WeightPush

    sent = []

    def worker(error: Exception):
        def finish_push():
            raise error

        stub = types.SimpleNamespace(
            _sends=[object()],
            _snapshot=(3, [], 0.0, None),
            rank=0,
            finish_push=finish_push,
            _send_snapshot=lambda: sent.append(3),
        )
        return types.MethodType(WeightPush.resend_push, stub)

    worker(CheckpointEngineError("shm: receiver 1 died"))(3)
    assert sent == [3]  # the dead member's failure: sent again
    with pytest.raises(CheckpointEngineAuthError, match="fails authentication"):
        worker(CheckpointEngineAuthError("gloo: message 'meta/0' fails authentication"))(3)
    assert sent == [3]
