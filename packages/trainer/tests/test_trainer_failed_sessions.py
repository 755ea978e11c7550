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
from rlwire.trainer.modes.one_step_off import sample_lags
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


def _mixed_batch() -> Rollout:
    """Rows 0 and 2: failed sessions (no token; their versions the padding's 0); row 1
    answered with version 4 (its last position padding, version 9), row 3 continued from
    version 5 to 6."""
    batch = _failed_batch(4)
    batch.response_ids = torch.ones((4, 3), dtype=torch.int64)
    batch.logprobs = torch.zeros((4, 3))
    batch.response_mask = torch.tensor([[0, 0, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1]])
    batch.versions = torch.tensor([[0, 0, 0], [4, 4, 9], [0, 0, 0], [5, 6, 6]])
    return batch


def test_a_batch_of_failed_sessions_only_has_no_version_and_no_lag():
    failed = _failed_batch()
    assert failed.sample_versions().tolist() == []  # was an IndexError
    assert failed.version is None  # was an IndexError
    assert failed.version_spans().tolist() == [0, 0, 0, 0]
    assert sample_lags(3, failed) == []
    assert failed.answered().tolist() == [False] * 4


def test_the_rows_of_failed_sessions_count_in_no_version_span_or_lag():
    """A failed session's row has no token, so no version (its stand-in, int64's maximum,
    made its span overflow to 1, a continued sample, and the lag -9.2e18, which turned the
    staleness-aware step size off)."""
    mixed = _mixed_batch()
    assert mixed.sample_versions().tolist() == [4, 5] and mixed.version == 4
    assert mixed.version_spans().tolist() == [0, 0, 0, 1]  # only row 3 was continued
    lags = sample_lags(6, mixed)
    assert lags == [2, 1]
    optim = load_config().actor.optim  # stale_lr_kl 0.1: the lag shrinks the step
    assert optim.lr_scale(sum(lags) / len(lags), kl=1.0) == pytest.approx(1 / 2.5)
    assert mixed.answered().tolist() == [False, True, False, True]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random tiny model with the lookup task's tokenizer: its chat template is what an
    agent's endpoint needs (the agents here never call the model: no priming)."""
    from rlwire.trainer.agent.lookup import build_lookup_tokenizer
    from rlwire.trainer.models.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("chat-model") / "tiny"
    return build_tiny_model(folder, tokenizer=build_lookup_tokenizer())


@pytest.mark.parametrize(
    ("mode", "max_failed"),
    [
        pytest.param("colocated", 10, id="raised-colocated"),
        pytest.param("one_step_off", 10, id="raised-one_step_off"),
        pytest.param("fully_async", 10, id="raised-fully_async"),
        # the stop is the mode-independent skip check's: one mode (colocated's stop is
        # the agent tests')
        pytest.param("fully_async", 2, id="reached-fully_async"),
    ],
)
def test_a_run_whose_every_session_fails_skips_its_steps_or_stops_in_one_line(
    ray_cluster, chat_model, tmp_path, mode, max_failed
):
    """Two steps of an agent that never calls the model (every row without a token): with
    ``agent.max_failed_steps`` above the run's length both are skipped and counted and the
    run exits 0; at 2 the second step stops the run in one line, in every mode (one-step off
    and fully async ended in a traceback: the versions of a batch of no token)."""
    from trainer_cli import metrics, run_cli

    run = tmp_path / "run"
    code, out = run_cli(
        run,
        f"trainer.mode={mode}",
        "data.source=builtin:lookup",
        f"model.path={chat_model}",
        "agent.function=agent_tools:no_call",
        f"agent.max_failed_steps={max_failed}",
        "trainer.steps=2",
        "data.train_batch_size=2",
        "rollout.n=2",
        cluster=ray_cluster,
    )
    assert "Traceback" not in out, out[-6000:]
    if max_failed == 2:
        assert code == 2, out[-6000:]
        assert (
            "rlwire-train: error: agent.function 'agent_tools:no_call': every session failed "
            "in 2 steps in a row (agent.max_failed_steps); the last: made no call to the model"
        ) in out.splitlines(), out[-6000:]
        return
    assert code == 0, out[-6000:]
    records = [r for r in metrics(run) if "reward_mean" in r]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["update_skipped"] is True and r["optimizer_steps"] == 0
        assert r["response_length"] == 0
        assert r["agent_failures"] == 4.0  # each of the 2 x 2 sessions, counted
        assert (r["version_lag_mean"], r["version_lag_max"], r["version_span_max"]) == (0, 0, 0)


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
