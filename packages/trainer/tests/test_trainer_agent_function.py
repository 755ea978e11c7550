"""Agents written against the OpenAI client (``agent.function``,
``rlwire.trainer.agent.function``): sessions through a rollout worker's endpoint become rows,
token for token; every way an agent fails gives reward 0, counted and named; the settings are
checked when the config loads."""

from __future__ import annotations

import logging
import re
import time
import types

import pytest
import torch

from rlwire.trainer.agent.function import FunctionRunner
from rlwire.trainer.agent.lookup import as_example, build_lookup_tokenizer
from rlwire.trainer.agent.sessions import merge_calls
from rlwire.trainer.checks import ConfigError
from rlwire.trainer.config import load_config
from rlwire.trainer.rollout.requests import request_seed


@pytest.fixture(scope="module")
def engine(lookup_core):
    """The lookup engine core (conftest) as a rollout engine: its ``submit``, tokenizer."""
    core, model, tokenizer = lookup_core
    return types.SimpleNamespace(submit=core.submit, tokenizer=tokenizer, model=model)


def _runner(engine, function: str, *more: str) -> FunctionRunner:
    config = load_config(
        overrides=[f"agent.function={function}", "rollout.max_new_tokens=12", *more]
    )
    return FunctionRunner(engine, engine.tokenizer, config)


EXAMPLES = [as_example("abc", "123", "lookup"), as_example("dej", "456", "lookup")]


def test_each_session_is_one_row_of_exactly_the_tokens_its_calls_sampled(engine):
    runner = _runner(engine, "agent_tools:chat_once")
    try:
        sessions: dict[int, list] = {}  # by seed: they end in any order
        runner.endpoint.sessions.close = _keep(runner.endpoint.sessions.close, sessions)
        out = runner.run(EXAMPLES, 2, seed=5)
    finally:
        runner.close()
    assert len(out) == 4 and out.trajectories is not None
    for row, trajectory in enumerate(out.trajectories):
        calls = sessions[request_seed(5, row)]
        (call,) = calls
        (sample,) = merge_calls(calls).samples
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()].tolist()
        length = len(call.token_ids)
        assert prompt == list(call.prompt_ids)
        assert out.response_ids[row, :length].tolist() == list(call.token_ids)
        assert out.response_mask[row].sum() == length == len(sample.mask)
        assert out.logprobs[row, :length].tolist() == pytest.approx(call.logprobs, abs=0)
        text = engine.tokenizer.decode(call.token_ids, skip_special_tokens=True)
        assert trajectory.rewards == [float(len(text))]  # chat_once's reward
        assert trajectory.extras == {"calls": 1.0} and trajectory.stop == "agent_returned"
        assert trajectory.calls == 1 and trajectory.breaks == 0 and trajectory.error is None
    assert len(runner.endpoint.sessions) == 0  # every session ended


def _keep(close, into: dict):
    def closing(session):
        calls = close(session)
        into[session.seed] = calls
        return calls

    return closing


@pytest.mark.parametrize(
    ("function", "error", "calls"),
    [
        ("agent_tools:raises", "raised RuntimeError: the agent's own bug", 1),
        ("agent_tools:no_reward", "returned no finite reward ({'answer': 'no reward key'})", 1),
        ("agent_tools:no_call", "made no call to the model", 0),
        ("agent_tools:sleeps_past_timeout", "ran past agent.timeout (2 s)", 1),
    ],
    ids=["raises", "no_reward", "no_call", "timeout"],
)
def test_a_failed_session_gets_reward_zero_and_is_named(engine, caplog, function, error, calls):
    runner = _runner(engine, function, "agent.timeout=2")
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="rlwire.trainer.agent"):
            out = runner.run(EXAMPLES[:1], 2, seed=1)
    finally:
        runner.close()
    assert time.monotonic() - start < 20  # the timed-out agent's sleep (30 s) is not waited
    assert out.trajectories is not None
    for trajectory in out.trajectories:
        assert trajectory.stop == "agent_failed" and trajectory.error == error
        assert trajectory.rewards == [0.0] and trajectory.calls == calls
    # what it sampled before failing is its row (trained on as a wrong answer's); none: empty
    assert (out.response_mask.sum(dim=1) > 0).tolist() == [calls > 0] * 2
    named = [r.getMessage() for r in caplog.records if function in r.getMessage()]
    assert len(named) == 2 and all(m.endswith(error) and "'abc'" in m for m in named)


def test_a_call_after_the_session_ended_is_refused_and_not_recorded(engine):
    import agent_tools

    runner = _runner(engine, "agent_tools:calls_after_its_end")
    agent_tools.LATE.clear()
    try:
        out = runner.run(EXAMPLES[:1], 2, seed=2)
        deadline = time.monotonic() + 20
        while len(agent_tools.LATE) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        runner.close()
    assert agent_tools.LATE == {"status": 401}
    assert out.trajectories is not None and [t.calls for t in out.trajectories] == [1, 1]
    assert [t.rewards for t in out.trajectories] == [[0.5], [0.5]]


def test_the_row_an_agent_gets_has_verl_keys(engine):
    from rlwire.trainer.agent.function import agent_row

    row = agent_row(as_example("abc", "123", "lookup"))
    assert row == {
        "prompt": [{"role": "user", "content": "abc"}],
        "data_source": "lookup",
        "reward_model": {"ground_truth": "123"},
        "extra_info": {"tools_kwargs": {"lookup": {"create_kwargs": {"table": {"abc": "123"}}}}},
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agent.function=agent_tools:not_async"], "is not an async function"),
        (["agent.function=agent_tools.chat_once"], "use a dotted path 'package.module:function'"),
        (["agent.function=agent_tools:nowhere"], "cannot import 'agent_tools:nowhere'"),
        (
            ["agent.function=agent_tools:chat_once", "agent.tools=[agent_tools:add]"],
            "leave agent.tools and agent.environment unset",
        ),
        (["agent.function=agent_tools:chat_once", "agent.failure=skip"], "use zero or drop"),
        (["agent.function=agent_tools:chat_once", "agent.timeout=0"], "use seconds > 0"),
    ],
)
def test_agent_function_settings_are_checked_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)


def test_the_lookup_task_with_an_agent_function_drops_its_tool_and_turns_agents_on():
    config = load_config(
        overrides=[
            "data.source=builtin:lookup",
            "agent.function=rlwire.trainer.agent.lookup_agent:solve",
        ]
    )
    assert config.agent.enable and config.agent.tools == []
    assert config.rollout.max_new_tokens == 24  # the task's other settings stay


def test_failed_sessions_drop_their_group_with_failure_drop():
    from rlwire.trainer.agent.trajectory import Trajectory
    from rlwire.trainer.algorithms.scoring import fill
    from rlwire.trainer.rollout.tokens import token_rollout

    config = load_config(
        overrides=[
            "agent.function=agent_tools:chat_once",
            "agent.failure=drop",
            "data.train_batch_size=2",
            "rollout.n=2",
        ]
    )
    tokenizer = build_lookup_tokenizer()

    def batch(stops: list[str], reward: float):
        out = token_rollout(tokenizer, [([5], [6], [-1.0])] * len(stops))
        out.trajectories = [Trajectory(rewards=[reward], stop=s) for s in stops]
        return out

    first = batch(["agent_returned", "agent_failed", "agent_returned", "agent_returned"], 1.0)
    more = batch(["agent_returned"] * 4, 2.0)
    whole, scored = fill(config, None, first, lambda missing: more)
    assert scored.filtered_groups == 1 and scored.gen_batches == 2
    assert whole.rewards.tolist() == [1.0, 1.0, 2.0, 2.0]  # group 2, then the refill's first
    assert config.fills_batches()
    assert torch.equal(whole.response_ids, torch.full((4, 1), 6))
