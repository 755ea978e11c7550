"""The OpenAI Agents SDK example (``examples/agents/lookup_agents_sdk.py``) through a rollout
worker's endpoint: the SDK runs the lookup task's loop, and each session is one exact
sequence (no break: the SDK sends back the assistant message as the endpoint answered it).
Runs with the SDK beside the workspace: ``bash .ci/agents`` (``-m agents_sdk``)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.agents_sdk
pytest.importorskip("agents", reason="needs openai-agents: see .ci/agents")

REPO = Path(__file__).resolve().parents[3]


def test_the_agents_sdk_example_trains_through_the_endpoint_token_for_token(monkeypatch):
    from cached_models import cached_lookup_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlwire.trainer.agent.function import FunctionRunner
    from rlwire.trainer.agent.lookup import lookup_reward
    from rlwire.trainer.config import load_config
    from rlwire.trainer.data.tasks import BUILTIN_TASKS
    from rlwire.trainer.rollout.hf_batch import HFBatch
    from rlwire.trainer.rollout.requests import EngineCore

    # The example is a file of the repository, as a user's is: on the path for this test only.
    monkeypatch.setattr(sys, "path", [*sys.path, str(REPO)])
    path = cached_lookup_model(seed=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    core = EngineCore(HFBatch(model, eos_id=eos, pad_id=pad), max_num_seqs=64)
    config = load_config(
        overrides=[
            "data.source=builtin:lookup",
            "agent.function=examples.agents.lookup_agents_sdk:solve",
        ]
    )
    runner = FunctionRunner(types.SimpleNamespace(submit=core.submit), tokenizer, config)
    examples = BUILTIN_TASKS["lookup"].examples(16, 5, "builtin:lookup")
    try:
        out = runner.run(examples, 8, seed=3)
    finally:
        runner.close()
        core.close()
    sessions = out.trajectories
    assert sessions is not None and len(sessions) == 128
    assert {t.stop for t in sessions} == {"agent_returned"}
    assert all(t.breaks == 0 for t in sessions)
    called = [i for i, t in enumerate(sessions) if t.calls == 2]
    assert called  # the primed model calls the tool in a few percent of its first turns
    for i in called:
        record = sessions[i]
        roles = [turn.role for turn in record.turns]
        assert roles == ["assistant", "context", "assistant"]
        assert "<tool_response>" in record.turns[1].text
        final = out.texts[i].rpartition("</tool_response>")[2]
        answer = examples[i // 8].answer
        assert record.rewards == [lookup_reward([""], [final], [answer])[0]]
