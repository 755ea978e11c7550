"""Multi-turn rollouts (``rlwire.trainer.agent``): tool calls parsed and run, every failure an
observation, token-exact conversations, the loss mask, ``trainer.rollout_data_dir``."""

from __future__ import annotations

import json
import types

import pytest
import torch

from rlwire.trainer.agent import HermesParser, ParsedCall, load_tools
from rlwire.trainer.agent.environment import ToolEnvironment, as_observation
from rlwire.trainer.agent.tools import ToolRunner
from rlwire.trainer.checks import ConfigError
from rlwire.trainer.rollout.config import RolloutConfig

TOOLS = "agent_tools"


def _runner(*names: str, timeout: float = 5.0) -> ToolRunner:
    return ToolRunner(load_tools([f"{TOOLS}:{n}" for n in names]), timeout, max_chars=64)


# --- parsing -------------------------------------------------------------------------------


def test_hermes_calls_are_read_in_order_with_arguments_as_objects_or_json_strings():
    text = (
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>'
    )
    calls = HermesParser().parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("add", {"a": 3, "b": 4}, None),
    ]
    assert HermesParser().parse("no call here") == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "the tool call is not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'a string "name"'),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '"arguments" must be'),
        ('<tool_call>{"name": "add"', "the <tool_call> is not closed"),
    ],
)
def test_a_malformed_call_is_a_call_with_its_error(text, error):
    (call,) = HermesParser().parse(text)
    assert error in call.error


# --- tools ---------------------------------------------------------------------------------


def test_a_tool_schema_comes_from_its_hints_and_docstring():
    (tool,) = load_tools([f"{TOOLS}:add"])
    assert tool.schema["function"]["name"] == "add"
    assert tool.schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert tool.schema["function"]["parameters"]["required"] == ["a", "b"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("agent_tools", "dotted path 'package.module:function'"),
        ("agent_tools:missing", "cannot import"),
        ("no_such_module:f", "cannot import"),
        ("agent_tools:undocumented", "has no JSON schema"),
    ],
)
def test_a_bad_tool_path_is_refused_naming_it(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_tools([spec])


def test_every_kind_of_failed_call_is_an_error_observation_and_the_good_ones_run():
    runner = _runner("add", "broken", "not_text", "slow_echo", timeout=5.0)
    calls = [
        ParsedCall("add", {"a": 2, "b": 3}),
        ParsedCall("broken", {"x": "k"}),
        ParsedCall("not_text", {"x": "k"}),
        ParsedCall("add", {"a": "two", "b": 3}),
        ParsedCall("add", {"a": 1}),
        ParsedCall("add", {"a": 1, "b": 2, "c": 3}),
        ParsedCall("search", {"q": "x"}),
        ParsedCall("", {}, error="the tool call is not JSON: x"),
        ParsedCall("slow_echo", {"text": "hi", "seconds": 0.01}),
    ]
    results = runner.run(calls)
    assert [r.text for r in results[:1]] == ["5"]
    assert results[-1].text == "hi" and results[-1].error is None
    errors = [r.error for r in results[1:-1]]
    assert "'broken' raised KeyError: 'k'" in errors[0]
    assert "'not_text' returned int, not text" in errors[1]
    assert "'a' must be integer" in errors[2]
    assert "missing 'b'" in errors[3]
    assert "unknown argument 'c'" in errors[4]
    assert "no tool named 'search'" in errors[5]
    assert "not JSON" in errors[6]
    assert all(r.text == f"Error: {r.error}" for r in results[1:-1])


def test_a_tools_keyword_only_arguments_come_from_the_row_and_never_from_the_model():
    """verl's ``extra_info.tools_kwargs.<tool>.create_kwargs``: the lookup tool's table is
    the row's; the schema does not offer it and a call that names it is refused."""
    from rlwire.trainer.agent.lookup import as_example
    from rlwire.trainer.rollout import Example

    (tool,) = load_tools(["rlwire.trainer.agent.lookup:lookup"])
    assert tool.bound == ("table",)
    assert tool.schema["function"]["parameters"]["properties"].keys() == {"key"}
    assert tool.schema["function"]["parameters"]["required"] == ["key"]
    runner = ToolRunner([tool], 5.0, max_chars=64)
    env = ToolEnvironment(runner, HermesParser(), max_calls=1)
    env.reset(as_example("abc", "907", "lookup"))
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>'
    assert [r.text for r in env.step(call).tool_results] == ["907"]
    forged = '{"name": "lookup", "arguments": {"key": "abc", "table": {"abc": "111"}}}'
    (refused,) = env.step(f"<tool_call>{forged}</tool_call>").tool_results
    assert "unknown argument 'table'" in (refused.error or "")
    other = '<tool_call>{"name": "lookup", "arguments": {"key": "abd"}}</tool_call>'
    (missing,) = env.step(other).tool_results
    assert "no entry 'abd': the key is the one in the prompt" in (missing.error or "")
    env.reset(Example(prompt="abc", answer="907"))
    (no_row,) = env.step(call).tool_results  # a row without the table
    assert "missing 1 required keyword-only argument: 'table'" in (no_row.error or "")


def test_lookup_rows_draw_codes_per_row_on_keys_priming_never_used():
    from rlwire.trainer.agent.lookup import lookup_examples, priming_key

    rows = lookup_examples(2000, seed=0)
    assert not any(priming_key(key) for key, _ in rows)
    by_key: dict[str, set[str]] = {}
    for key, code in rows:
        by_key.setdefault(key, set()).add(code)
    repeated = [codes for codes in by_key.values() if len(codes) > 1]
    assert len(repeated) > 100  # a key's code differs from row to row: none to memorise


@pytest.mark.job  # with the lookup jobs it vouches for: priming costs 20-70 s on a cold cache
def test_the_reading_probe_answers_follow_what_the_tool_returns(lookup_model):
    """The primed model, on data rows' keys (never seen in priming): given a tool result
    that is not the row's code, its greedy answer is the tool's code, never the row's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlwire.trainer.agent.lookup import reading_probe

    model = AutoModelForCausalLM.from_pretrained(lookup_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(lookup_model)
    got = reading_probe(model, tokenizer, count=64, seed=11)
    assert got["follows_tool"] >= 0.9 and got["follows_row_tool"] >= 0.9
    assert got["row_code"] <= 0.05 and got["key_written"] >= 0.9


@pytest.mark.parametrize("tool", ["hang", "slow_echo"])
def test_a_tool_past_its_timeout_is_an_error_not_a_stuck_worker(tool):
    runner = _runner(tool, timeout=0.2)
    arguments = {"seconds": 30.0} if tool == "hang" else {"text": "x", "seconds": 30.0}
    (result,) = runner.run([ParsedCall(tool, arguments)])
    assert result.error == f"{tool!r} did not answer within 0.2 s"
    assert result.seconds < 30


def test_calls_beyond_the_parallel_limit_are_dropped_and_counted():
    env = ToolEnvironment(_runner("add"), HermesParser(), max_calls=1)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    answer = env.step(call * 3)
    assert answer.dropped_calls == 2
    assert [m["content"] for m in answer.messages] == ["2"]
    assert env.step("just an answer").messages == []


def test_an_environment_answer_in_any_allowed_form_becomes_an_observation():
    assert as_observation(("hi", 1, False)).messages == [{"role": "user", "content": "hi"}]
    assert as_observation((None, 0.5, True)).done
    with pytest.raises(TypeError, match="list of chat"):
        as_observation((3, 0.0, False))
    with pytest.raises(TypeError, match="Observation or"):
        as_observation("hi")


# --- token in, token out -------------------------------------------------------------------

_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>{{ m.content }}<eos>;"
    "{%- elif m.role == 'assistant' -%}<|assistant|>{{ m.content }}<eos>;"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""Every turn ends with ``<eos>`` then ``;``: a separator the model never samples (as Qwen's
newline after ``<|im_end|>``), which must still reach the sequence."""


def _tokenizer():
    """A tokenizer whose decode/encode is not a bijection: ``aa`` is one token, so the
    sampled ``a a`` decodes to ``aa`` and encodes back as one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "aa", *"abcxyleft 123;"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("aa|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    fast.chat_template = _TEMPLATE
    return fast


class ScriptedEngine:
    """The engine seam's ``submit`` with chosen tokens (a test double of a sampler): each
    conversation (told apart by its prompt) gets its script's next turn per request (cut at
    the request's budget), each token with log-prob ``-0.5`` and weight version
    ``version``; every request's context is recorded."""

    def __init__(self, scripts: dict[tuple[int, ...], list[list[int]]], eos: int) -> None:
        self.scripts, self.eos = scripts, eos
        self.turn = {key: 0 for key in scripts}
        self.calls: list[list[int]] = []
        self.version = 7

    def _key(self, context: list[int]) -> tuple[int, ...]:
        return next(k for k in self.scripts if tuple(context[: len(k)]) == k)

    def submit(self, request):
        import concurrent.futures

        from rlwire.trainer.rollout.requests import Completion

        context = list(request.prompt_ids)
        self.calls.append(context)
        key = self._key(context)
        new = self.scripts[key][self.turn[key]][: request.max_new_tokens]
        self.turn[key] += 1
        finish = "stop" if new and new[-1] == self.eos else "length"
        done = Completion(
            request.request_id, new, [-0.5] * len(new), [self.version] * len(new), finish
        )
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(done)
        return future


def test_a_three_turn_conversation_is_exactly_the_tokens_the_engine_was_given_and_gave():
    from rlwire.trainer.agent.config import AgentConfig
    from rlwire.trainer.agent.loop import AgentLoop
    from rlwire.trainer.agent.render import ChatRenderer
    from rlwire.trainer.rollout import Example

    tok = _tokenizer()
    ids = tok.convert_tokens_to_ids
    a, b, c, eos = ids("a"), ids("b"), ids("c"), tok.eos_token_id
    examples = [
        Example(prompt="x", answer="", messages=[{"role": "user", "content": "x"}]),
        Example(prompt="y", answer="", messages=[{"role": "user", "content": "y"}]),
    ]
    renderer = ChatRenderer(tok)
    prompts = [renderer.prompt(e) for e in examples]
    assert prompts[0] == [ids("<|user|>"), ids("x"), eos, ids(";"), ids("<|assistant|>")]
    # "a a b": decoded "aab", which encodes as "aa b": kept as sampled
    scripts = {
        tuple(prompts[0]): [[a, a, b, eos], [c, eos], [a, a, a, eos]],
        tuple(prompts[1]): [[b, eos], [a, a, eos], [c, c, eos]],
    }
    assert tok("aab", add_special_tokens=False)["input_ids"] == [ids("aa"), b]
    engine = ScriptedEngine(scripts, eos)
    from agent_tools import Countdown

    loop = AgentLoop(engine, tok, renderer, Countdown, AgentConfig(enable=True), 64)
    out = loop.run(examples, 1, seed=0)

    separator = [ids(";")]
    for row, prompt in enumerate(prompts):
        expected, mask, given = [], [], []
        for number, turn in enumerate(scripts[tuple(prompt)]):
            given.append(prompt + expected)
            expected += turn
            mask += [1] * len(turn)
            if number < 2:  # the environment's turn, as the template renders it
                env = renderer.turn([{"role": "user", "content": f"left {2 - number}"}])
                assert env[: len(separator)] == separator
                expected += env
                mask += [0] * len(env)
        length = len(expected)
        assert out.prompt_ids[row][out.prompt_mask[row].bool()].tolist() == prompt
        assert out.response_ids[row, :length].tolist() == expected
        assert out.response_mask[row].tolist() == mask + [0] * (out.response_mask.shape[1] - length)
        model = torch.tensor(mask, dtype=torch.bool)
        assert torch.equal(out.logprobs[row, :length][model], torch.full((int(model.sum()),), -0.5))
        assert not out.logprobs[row, :length][~model].any()
        # every engine call was given exactly the tokens so far, and each turn began with all
        # of the conversation before it
        mine = [ctx for ctx in engine.calls if ctx[: len(prompt)] == prompt]
        assert mine == given
        record = out.trajectories[row]
        assert [t.role for t in record.turns] == ["assistant", "user"] * 2 + ["assistant"]
        assert record.rewards == [0.25, 0.25, 0.25] and record.stop == "done"
    assert set(out.versions[0][out.response_mask[0].bool()].tolist()) == {7}  # the engine's


# --- the loss mask -------------------------------------------------------------------------


class _KeepLogits(torch.nn.Module):
    """The model, keeping the logits of every forward with their gradient."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.kept = model, []

    def forward(self, **inputs):
        out = self.model(**inputs)
        out.logits.retain_grad()
        self.kept.append(out.logits)
        return out


def test_the_loss_gives_masked_tokens_logits_exactly_zero_gradient(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlwire.trainer.algorithms.step import grpo_update
    from rlwire.trainer.models.tiny import build_tiny_model
    from rlwire.trainer.rollout import Rollout

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))
    torch.manual_seed(0)
    B, P, T = 4, 3, 10
    # model tokens, then an environment turn (mask 0), then model tokens, then padding
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 0, 0]] * B)
    rollout = Rollout(
        torch.randint(4, 20, (B, P)),
        torch.ones((B, P), dtype=torch.long),
        torch.randint(4, 20, (B, T)),
        mask,
        -torch.rand(B, T) * mask,
        [""] * B,
    )
    wrapped = _KeepLogits(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grpo_update(
        wrapped,
        optimizer,
        rollout,
        None,
        torch.tensor([1.0, -1.0, 0.5, -0.5]),
        micro_batch_size=B,
        temperature=1.0,
        clip_ratio=0.2,
    )
    (logits,) = wrapped.kept
    # position P - 1 + t predicts response token t
    grad = logits.grad[:, P - 1 : P - 1 + T]
    assert torch.count_nonzero(grad[:, ~mask[0].bool()]) == 0
    assert torch.count_nonzero(grad[:, mask[0].bool()]) > 0


def _scripted_loop(tool_or_env: str, turns: list[list[str]], **agent):
    """An agent loop over :class:`ScriptedEngine` saying ``turns`` (text, one list per
    turn) for one conversation, with a tool (``agent_tools:<name>``) or an environment."""
    from rlwire.trainer.agent.config import AgentConfig
    from rlwire.trainer.agent.loop import build_loop
    from rlwire.trainer.rollout import Example

    tok = _tokenizer()
    spec = f"{TOOLS}:{tool_or_env}"
    config = AgentConfig(
        enable=True,
        **({"environment": spec} if tool_or_env[0].isupper() else {"tools": [spec]}),
        **agent,
    )

    # the parts of the trainer's config build_loop reads
    whole = types.SimpleNamespace(
        agent=config,
        rollout=RolloutConfig(max_new_tokens=200, request_timeout=60.0),
    )
    example = Example(prompt="x", answer="", messages=[{"role": "user", "content": "x"}])

    engine = ScriptedEngine({}, tok.eos_token_id)
    engine.tokenizer = tok
    loop = build_loop(whole, engine, "")
    prompt = loop.renderer.prompt(example)
    script = [[*(tok.convert_tokens_to_ids(t) for t in turn), tok.eos_token_id] for turn in turns]
    engine.__init__({tuple(prompt): script}, tok.eos_token_id)
    return loop.run([example], 1, seed=0)


def test_a_hanging_tool_becomes_an_error_observation_and_the_conversation_goes_on():
    # the tools' environment as the loop steps it (in a thread of its own) with a message
    # calling a tool that blocks its thread for a minute
    runner = _runner("stall", timeout=0.3)
    env = ToolEnvironment(runner, HermesParser(), max_calls=1)
    answer = env.step('<tool_call>{"name": "stall", "arguments": {"key": "k"}}</tool_call>')
    (result,) = answer.tool_results
    assert result.error == "'stall' did not answer within 0.3 s"
    assert answer.messages == [
        {"role": "tool", "name": "stall", "content": f"Error: {result.error}"}
    ]
    assert not answer.done


def test_an_environment_that_fails_ends_its_conversation_with_the_error_recorded():
    out = _scripted_loop("Raises", [["a"]])
    (record,) = out.trajectories
    assert record.stop == "error"
    assert record.error == "environment step raised RuntimeError: the sandbox is gone"
    assert record.tool_errors == 1


def test_turn_limits_end_a_conversation():
    out = _scripted_loop("Countdown", [["a"], ["b"], ["c"]], max_assistant_turns=2)
    (record,) = out.trajectories
    assert record.stop == "max_assistant_turns" and record.assistant_turns == 2
    out = _scripted_loop("Countdown", [["a"], ["b"], ["c"]], max_user_turns=1)
    (record,) = out.trajectories
    assert record.stop == "max_user_turns" and [t.role for t in record.turns] == [
        "assistant",
        "user",
        "assistant",
    ]


# --- the lookup task, end to end -----------------------------------------------------------


@pytest.fixture(scope="module")
def lookup_model():
    from cached_models import cached_lookup_model

    # seed 1: primed in about 20 s here, once per machine
    return cached_lookup_model(seed=1)


@pytest.mark.parametrize(
    "mode",
    [
        ("trainer.mode=colocated",),
        ("trainer.mode=one_step_off",),
        (
            "trainer.mode=fully_async",
            "rollout.num_workers=2",
            "async.partial_rollout=true",
            "async.partial_rollout_chunk_tokens=4",
        ),
    ],
    ids=["colocated", "one_step_off", "fully_async"],
)
def test_the_lookup_task_learns_to_call_its_tool_in_every_mode(
    ray_cluster, lookup_model, tmp_path, mode
):
    from trainer_cli import train_cli

    from rlwire.trainer.agent.lookup import lookup_reward

    data = tmp_path / "rollouts"
    records, _ = train_cli(
        tmp_path / "run",
        "data.source=builtin:lookup",
        f"model.path={lookup_model}",
        "trainer.seed=1",
        "trainer.steps=20",
        f"trainer.rollout_data_dir={data}",
        *mode,
        cluster=ray_cluster,
    )
    first, last = records[0], records[-5:]
    samples = 8 * 8
    # the primed model calls in a few answers and guesses otherwise (chance: 0.1)
    # measured (colocated): 0.22 and 16% calls at step 1; 0.93 and 99% over the last 5
    assert first["reward_mean"] < 0.35 and first["tool_calls_mean"] < 0.5
    assert sum(r["reward_mean"] for r in last) / 5 > 0.45
    assert sum(r["tool_calls_mean"] for r in last) / 5 > 0.8
    # the samples each step trained, read back
    lines = [json.loads(x) for x in (data / "20.jsonl").read_text().splitlines()]
    assert len(lines) == samples and {x["step"] for x in lines} == {20}
    # a sample with one call, answered (a conversation may also end on a call: at
    # max_assistant_turns or the length budget, the environment is not asked)
    called = next(
        x
        for x in lines
        if len(x["tool_calls"]) == 1 and any(t["role"] == "tool" for t in x["turns"])
    )
    mask = called["loss_mask"]
    assert len(mask) == len(called["response_ids"]) == len(called["logprobs"])
    assert [lp is None for lp in called["logprobs"]] == [m == 0 for m in mask]
    (call,) = called["tool_calls"]
    assert call["name"] == "lookup" and set(call["arguments"]) == {"key"}
    tool_turn = next(t for t in called["turns"] if t["role"] == "tool")
    assert set(mask[tool_turn["start"] : tool_turn["end"]]) == {0}
    expected = lookup_reward([""], [called["response"]], [called["answer"]])[0]
    assert called["reward"] == pytest.approx(expected, abs=1e-6)  # float32 in the batch
    assert [x["prompt_index"] for x in lines] == [i // 8 for i in range(samples)]


def test_an_openai_agent_learns_the_lookup_task_through_the_endpoint_fully_async(
    ray_cluster, lookup_model, tmp_path
):
    """``agent.function``: the task as an agent written only with the ``openai`` client
    (``lookup_agent.solve``), its calls through the rollout workers' endpoints while weights
    are synced under them (fully async, partial rollouts): it learns as the built-in loop
    does, and each trained row is the session's calls merged, token for token."""
    from trainer_cli import train_cli

    from rlwire.trainer.agent.lookup import lookup_reward

    data = tmp_path / "rollouts"
    records, _ = train_cli(
        tmp_path / "run",
        "data.source=builtin:lookup",
        f"model.path={lookup_model}",
        "agent.function=rlwire.trainer.agent.lookup_agent:solve",
        "trainer.seed=1",
        "trainer.steps=20",
        "data.train_batch_size=4",
        f"trainer.rollout_data_dir={data}",
        "trainer.mode=fully_async",
        "rollout.num_workers=2",
        "async.partial_rollout=true",
        "async.partial_rollout_chunk_tokens=4",
        cluster=ray_cluster,
    )
    first, last = records[0], records[-5:]
    # 32 sessions a step: measured 0.25 at step 1, 0.81 over the last 5 (chance 0.1, also
    # for a model that calls and does not read: the codes are per row)
    assert first["reward_mean"] < 0.4 and first["model_calls_mean"] < 1.5
    assert sum(r["reward_mean"] for r in last) / 5 > 0.5
    assert sum(r["model_calls_mean"] for r in last) / 5 > 1.7  # it calls the tool
    assert all(r["agent_failures"] == 0 and r["agent_breaks"] == 0 for r in records)
    lines = [json.loads(x) for x in (data / "20.jsonl").read_text().splitlines()]
    assert len(lines) == 32 and {x["stop"] for x in lines} == {"agent_returned"}
    called = next(x for x in lines if x["model_calls"] == 2)
    mask, turns = called["loss_mask"], called["turns"]
    assert [t["role"] for t in turns] == ["assistant", "context", "assistant"]
    assert set(mask[turns[1]["start"] : turns[1]["end"]]) == {0}
    assert [lp is None for lp in called["logprobs"]] == [m == 0 for m in mask]
    assert "<tool_response>" in turns[1]["text"]  # the tool's result, read from the session
    expected = lookup_reward([""], [called["response"]], [called["answer"]])[0]
    assert called["reward"] == pytest.approx(expected, abs=1e-6)
    versions = [v for x in lines for v in x["versions"] if v is not None]
    assert max(versions) - min(versions) <= 2  # tokens of the versions in flight


def test_verl_multi_turn_keys_set_the_agent_section_and_its_tool_config_is_refused_with_why():
    from rlwire.trainer.config.root import load_config

    config = load_config(
        overrides=[
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",
            "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=null",
            f"agent.tools=[{TOOLS}:add]",
        ]
    )
    agent = config.agent
    assert (agent.enable, agent.max_assistant_turns, agent.max_user_turns) == (True, 4, 3)
    assert agent.max_parallel_calls == 2 and agent.tools == [f"{TOOLS}:add"]
    with pytest.raises(ConfigError, match="name plain Python functions in agent.tools"):
        load_config(overrides=["actor_rollout_ref.rollout.multi_turn.tool_config_path=t.yaml"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["agent.enable=true", "rollout.backend=paced"], None),
        (["agent.format=xml"], "agent.format: 'xml' is not allowed; use 'hermes'"),
        (["agent.tools=[agent_tools:nope]"], "cannot import"),
        (["agent.environment=agent_tools:add"], "not a Environment subclass"),
        (["agent.tool_timeout=0"], "agent.tool_timeout"),
        (
            ["data.source=builtin:lookup", "validation.source=builtin:lookup"],
            "validation.do_sample=true and validation.temperature=1.0",
        ),
    ],
)
def test_agent_settings_are_checked_when_the_config_loads(overrides, message):
    from rlwire.trainer.config.root import load_config

    if message is None:  # paced continues from token ids: allowed
        assert load_config(overrides=overrides).agent.enable
        return
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_single_turn_samples_are_written_in_the_same_format(tmp_path):
    from rlwire.trainer.outputs.rollout_data import write_rollouts
    from rlwire.trainer.rollout import Example, Rollout

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = Rollout(
        torch.tensor([[0, 5], [6, 7]]),
        torch.tensor([[0, 1], [1, 1]]),
        torch.tensor([[8, 2, 0], [2, 0, 0]]),
        mask,
        torch.tensor([[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0]]),
        ["ab", ""],
        versions=torch.tensor([[3, 3, 0], [2, 0, 0]]),
        examples=[Example(prompt="p", answer="a")] * 2,
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]),
    )
    path = write_rollouts(tmp_path / "data", 4, batch, n=2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert path.name == "4.jsonl" and len(lines) == 2
    assert lines[0] == {
        "step": 4,
        "prompt_index": 0,
        "prompt": "p",
        "answer": "a",
        "response": "ab",
        "prompt_ids": [5],
        "response_ids": [8, 2],
        "loss_mask": [1, 1],
        "logprobs": [-0.5, -0.25],
        "versions": [3, 3],
        "reward": 1.0,
        "advantage": pytest.approx(0.7),
    }
    assert lines[1]["response_ids"] == [2] and lines[1]["versions"] == [2]


def test_an_environment_whose_rewards_are_not_finite_stops_the_run_naming_it():
    from rlwire.trainer.agent.trajectory import Trajectory
    from rlwire.trainer.algorithms.scoring import score
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.errors import RunError

    config = load_config(overrides=["agent.enable=true", "agent.environment=agent_tools:Countdown"])
    batch = types.SimpleNamespace(
        trajectories=[Trajectory(rewards=[1.0, 0.5]), Trajectory(rewards=[float("nan")])]
    )
    with pytest.raises(RunError) as err:
        score(config, None, batch)
    assert str(err.value) == (
        "agent.environment 'agent_tools:Countdown': the step rewards of conversation 1 sum to "
        "nan; rewards must be finite numbers (1 of 2 were not)"
    )
    batch.trajectories[1].rewards = [2.0]
    assert score(config, None, batch).rewards.tolist() == [1.5, 2.0]
