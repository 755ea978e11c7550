"""The OpenAI-compatible agent endpoint (``rlwire.trainer.agent.endpoint``) on an ``hf``
engine core, called with the real ``openai`` client; its sessions and how their calls merge
into training samples, token for token (``rlwire.trainer.agent.sessions``)."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from rlwire.trainer.agent.endpoint import Endpoint
from rlwire.trainer.agent.lookup import build_lookup_tokenizer
from rlwire.trainer.agent.parsers import HermesParser
from rlwire.trainer.agent.render import ChatRenderer
from rlwire.trainer.agent.sessions import CallRecord, SessionStore, merge_calls


@pytest.fixture(scope="module")
def served(lookup_core):
    """The lookup engine core (conftest) behind an endpoint on loopback."""
    engine, model, tokenizer = lookup_core
    endpoint = Endpoint(
        engine.submit, tokenizer, HermesParser(), temperature=1.0, max_new_tokens=16, timeout=60
    )
    url = endpoint.start()
    yield endpoint, url, model, tokenizer
    endpoint.stop()


def _extra(obj, key):
    return (obj.model_extra or {})[key]


def test_an_openai_client_chats_and_its_calls_merge_into_one_exact_sequence(served):
    """Two chat calls of one session, the second after the first's reply and a new user
    message: the second's prompt is the first's prompt and sampled tokens, exactly, then the
    template's rendering of the new message; the two merge into one sample whose sampled
    tokens (mask 1) carry the log-probs the answers gave, which are the model's."""
    endpoint, url, model, tokenizer = served
    session = endpoint.sessions.open(seed=7)
    messages = [{"role": "user", "content": "abc"}]

    async def talk():
        async with openai.AsyncOpenAI(base_url=url, api_key=session.key) as client:
            chat = client.chat.completions
            first = await chat.create(model="rlwire-policy", messages=messages)
            history = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
            history.append({"role": "user", "content": "d"})
            second = await chat.create(model="rlwire-policy", messages=history)
        return first, second

    first, second = asyncio.run(talk())
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        _extra(first, "prompt_token_ids")
        == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )
    sampled = _extra(first.choices[0], "token_ids")
    assert sampled[-1] == tokenizer.eos_token_id and first.choices[0].finish_reason == "stop"
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    assert first.choices[0].message.content == (text or None)
    turn = ChatRenderer(tokenizer).turn([{"role": "user", "content": "d"}])
    assert _extra(second, "prompt_token_ids") == _extra(first, "prompt_token_ids") + sampled + turn
    calls = endpoint.sessions.close(session)
    merged = merge_calls(calls)
    assert merged.breaks == 0 and len(merged.samples) == 1
    (sample,) = merged.samples
    second_ids = _extra(second.choices[0], "token_ids")
    assert sample.response_ids == sampled + turn + second_ids
    assert sample.mask == [1] * len(sampled) + [0] * len(turn) + [1] * len(second_ids)
    answered = [c.logprob for c in first.choices[0].logprobs.content]
    answered += [c.logprob for c in second.choices[0].logprobs.content]
    kept = [lp for lp, m in zip(sample.logprobs, sample.mask, strict=True) if m]
    assert kept == pytest.approx(answered, abs=0)
    # the model's own log-probs of the merged sequence (temperature 1), at the sampled tokens
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    recomputed = torch.log_softmax(logits, -1).gather(1, ids[0, len(sample.prompt_ids) :, None])
    mask = torch.tensor(sample.mask, dtype=torch.bool)
    assert torch.allclose(recomputed[:, 0][mask], torch.tensor(kept), atol=1e-4)
    assert _extra(second, "weight_versions") == [0] * len(second_ids)


def test_calls_with_an_unknown_or_ended_session_or_a_bad_body_are_refused(served):
    endpoint, url, _, _ = served
    session = endpoint.sessions.open(seed=1)

    async def call(key, **body):
        async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as client:
            return await client.chat.completions.create(model="rlwire-policy", **body)

    hello = {"messages": [{"role": "user", "content": "a"}]}
    with pytest.raises(openai.AuthenticationError, match="unknown or ended session"):
        asyncio.run(call("rlwire-session-guessed", **hello))
    with pytest.raises(openai.BadRequestError, match="messages: use a non-empty list"):
        asyncio.run(call(session.key, messages=[]))
    with pytest.raises(openai.BadRequestError, match="max_tokens: 0; use an int >= 1"):
        asyncio.run(call(session.key, max_tokens=0, **hello))
    assert asyncio.run(call(session.key, **hello)).choices[0].finish_reason in ("stop", "length")
    assert len(endpoint.sessions.close(session)) == 1  # the refused calls left nothing
    with pytest.raises(openai.AuthenticationError, match="unknown or ended session"):
        asyncio.run(call(session.key, **hello))


def test_completions_take_token_ids_and_answer_with_the_sampled_ones(served):
    endpoint, url, _, tokenizer = served
    session = endpoint.sessions.open(seed=3)
    client = openai.AsyncOpenAI(base_url=url, api_key=session.key, max_retries=0)
    prompt = tokenizer("ab:", add_special_tokens=False)["input_ids"]
    out = asyncio.run(client.completions.create(model="rlwire-policy", prompt=prompt, max_tokens=4))
    (call,) = endpoint.sessions.close(session)
    assert list(call.prompt_ids) == prompt == _extra(out, "prompt_token_ids")
    assert list(call.token_ids) == _extra(out.choices[0], "token_ids")
    assert len(call.token_ids) <= 4
    assert out.choices[0].logprobs.token_logprobs == list(call.logprobs)


def test_a_chat_turn_reuses_the_sampled_tokens_where_decoding_would_not_give_them_back():
    """The model wrote ``<tool_call>`` one character at a time; decoded and encoded again
    that is one token (an added token of the lookup tokenizer). The next call's prompt keeps
    the sampled characters, and the session merges into one sample holding them."""
    tokenizer = build_lookup_tokenizer()
    endpoint = Endpoint(
        None, tokenizer, HermesParser(), temperature=1.0, max_new_tokens=8, timeout=1
    )  # type: ignore[arg-type]
    session = endpoint.sessions.open(seed=0)
    messages = [{"role": "user", "content": "abc"}]
    prompt = endpoint._chat_prompt(session, messages, [])
    chars = [tokenizer.convert_tokens_to_ids(c) for c in "<tool_call>"]
    sampled = (*chars, tokenizer.eos_token_id)
    reply = {"role": "assistant", "content": "<tool_call>"}
    assert tokenizer("<tool_call>", add_special_tokens=False)["input_ids"] != chars
    session.record(
        CallRecord(tuple(prompt), sampled, (-1.0,) * len(sampled), (0,) * len(sampled),
                   messages=tuple(messages), reply=reply)
    )  # fmt: skip
    tool = {"role": "tool", "content": "123"}
    again = endpoint._chat_prompt(session, [*messages, reply, tool], [])
    assert again == prompt + list(sampled) + ChatRenderer(tokenizer).turn([tool])
    whole = tokenizer.apply_chat_template(
        [*messages, reply, tool], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer(whole, add_special_tokens=False)["input_ids"] != again  # what we avoid
    # an agent that rewrote its history: rendered whole, and a second sample
    rewritten = [{"role": "user", "content": "abd"}, reply, tool]
    fresh = endpoint._chat_prompt(session, rewritten, [])
    session.record(CallRecord(tuple(fresh), (5,), (-0.5,), (1,), messages=tuple(rewritten)))
    merged = merge_calls(session.end())
    assert merged.breaks == 1 and len(merged.samples) == 2
    assert merged.samples[0].response_ids == list(sampled)
    assert merged.samples[1].prompt_ids == fresh and merged.samples[1].versions == [1]


def test_tool_calls_in_a_reply_come_back_in_the_openai_shape():
    endpoint = Endpoint(None, build_lookup_tokenizer(), HermesParser(), temperature=1.0,
                        max_new_tokens=8, timeout=1)  # type: ignore[arg-type]  # fmt: skip
    text = 'let me see <tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>'
    content, calls = endpoint._tool_calls(text)
    assert content == "let me see"
    assert [c["function"] for c in calls] == [{"name": "lookup", "arguments": '{"key": "abc"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert endpoint._tool_calls("no call here") == ("no call here", [])


def test_a_session_store_gives_unguessable_keys_and_forgets_ended_sessions():
    store = SessionStore()
    a, b = store.open(seed=0), store.open(seed=1)
    assert a.key != b.key and len(a.key) > 40 and store.get(a.key) is a
    store.close(a)
    assert store.get(a.key) is None and len(store) == 1
    assert not a.record(CallRecord((1,), (2,), (0.0,), (0,)))
    with pytest.raises(ValueError, match="one each per token"):
        CallRecord((1,), (2, 3), (0.0,), (0,))


def test_a_chat_call_to_a_model_without_a_chat_template_is_refused_naming_it():
    from rlwire.trainer.agent.endpoint import _Refused
    from rlwire.trainer.models.tiny import build_tokenizer

    endpoint = Endpoint(None, build_tokenizer(), HermesParser(), temperature=1.0,
                        max_new_tokens=8, timeout=1)  # type: ignore[arg-type]  # fmt: skip
    session = endpoint.sessions.open(seed=0)
    body = {"messages": [{"role": "user", "content": "a"}]}
    with pytest.raises(_Refused, match="has no chat template") as refused:
        asyncio.run(endpoint._chat(session, body))
    assert refused.value.status == 400 and session.calls == []


def test_bad_token_ids_and_a_prompt_past_the_context_are_refused_before_the_engine():
    """400 naming the limit; the engine is never asked (a bad id in a shared batch would fail
    every session's request in it, and on CUDA kill the worker)."""
    import asyncio

    from rlwire.trainer.agent.endpoint import _Refused

    asked = []

    def submit(request):
        asked.append(request)
        raise AssertionError("the engine must not see it")

    tokenizer = build_lookup_tokenizer()
    endpoint = Endpoint(submit, tokenizer, HermesParser(), temperature=1.0, max_new_tokens=8,
                        timeout=1, context=16)  # type: ignore[arg-type]  # fmt: skip
    session = endpoint.sessions.open(seed=0)
    vocabulary = len(tokenizer)
    for prompt, message in [
        ([5, -1], f"prompt: token id -1 is outside the vocabulary (0 to {vocabulary - 1})"),
        ([5, vocabulary], f"prompt: token id {vocabulary} is outside the vocabulary"),
        ([True, 5], "prompt: token id True is outside the vocabulary"),
        ([5] * 16, "prompt: 16 tokens; the model's context is 16, which must leave room"),
    ]:
        with pytest.raises(_Refused) as err:
            asyncio.run(endpoint._sample(session, prompt, {}))
        assert err.value.status == 400 and err.value.message.startswith(message)
    assert asked == []


def test_a_token_id_past_the_models_vocabulary_is_refused_though_the_tokenizer_has_it():
    """Ids lie below the smaller of the tokenizer's length and the model's vocabulary (issue
    70, item 6; before: the tokenizer's length alone, so an added token the model has no
    embedding row for reached the engine: on CUDA a device-side assert in a shared batch)."""
    from rlwire.trainer.agent.endpoint import _Refused

    def submit(request):
        raise AssertionError("the engine must not see it")

    tokenizer = build_lookup_tokenizer()
    model = len(tokenizer) - 2  # two added tokens past the model's embedding
    endpoint = Endpoint(submit, tokenizer, HermesParser(), temperature=1.0, max_new_tokens=8,
                        timeout=1, vocabulary=model)  # type: ignore[arg-type]  # fmt: skip
    session = endpoint.sessions.open(seed=0)
    for bad in (model, len(tokenizer) - 1):
        with pytest.raises(_Refused) as err:
            asyncio.run(endpoint._sample(session, [5, bad], {}))
        assert err.value.status == 400
        assert err.value.message == (
            f"prompt: token id {bad} is outside the vocabulary (0 to {model - 1})"
        )
    # a model that pads its embedding past the tokenizer: the tokenizer's ids bound them
    padded = Endpoint(None, tokenizer, HermesParser(), temperature=1.0, max_new_tokens=8,
                      timeout=1, vocabulary=len(tokenizer) + 64)  # type: ignore[arg-type]  # fmt: skip
    assert padded.vocabulary == len(tokenizer)
    with pytest.raises(ValueError, match=r"vocabulary: 0; use the model's size, an int >= 1"):
        Endpoint(None, tokenizer, HermesParser(), temperature=1.0, max_new_tokens=8, timeout=1,
                 vocabulary=0)  # type: ignore[arg-type]  # fmt: skip


def test_the_agent_runner_takes_the_vocabulary_from_the_engines_model():
    """``hf``: the model's config (a multimodal one's text config); in-process ``vllm``: its
    model config; an engine that says nothing: None (the tokenizer's length bounds ids)."""
    import types

    from transformers import PretrainedConfig

    from rlwire.trainer.agent.function import engine_vocabulary

    hf = types.SimpleNamespace(model=types.SimpleNamespace(config=PretrainedConfig(vocab_size=96)))
    assert engine_vocabulary(hf) == 96
    model_config = types.SimpleNamespace(get_vocab_size=lambda: 151936)
    vllm = types.SimpleNamespace(
        llm=types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_config=model_config))
    )
    assert engine_vocabulary(vllm) == 151936
    assert engine_vocabulary(types.SimpleNamespace(submit=None)) is None
