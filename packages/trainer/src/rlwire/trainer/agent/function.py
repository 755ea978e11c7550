"""Agents written against the OpenAI client (``agent.function``): each conversation is a call of
the user's ``async def agent(row, client)``, its model calls made through this rollout
worker's endpoint (:mod:`.endpoint`) with a session of its own, and what the policy sampled in
them becomes the training sample, token for token (:func:`.sessions.merge_calls`).

The agent runs in a thread of its own with an event loop of its own (:class:`.calls.Call`):
an agent that blocks (a sync HTTP call, ``time.sleep`` in a coroutine) holds only itself, and
one past ``agent.timeout`` is stopped. Its session ends when it returns, fails or is stopped;
a call made after that is refused (401) and nothing of it is recorded.

A session that **failed** (the agent raised, returned no finite reward, made no call to the
model, or ran past ``agent.timeout``) gets reward 0 (``agent.failure=zero``: its sampled
tokens are trained on as a wrong answer's), or its group is replaced by another prompt's, as
dynamic sampling replaces a group (``agent.failure=drop``); either way it is counted
(``agent_failures``; ``filtered_groups`` with ``drop``), and each is named in the worker's
log and in its trajectory's ``error``.

A session whose calls did not extend each other token for token (the agent rewrote its
history: a break) is trained on its **last** sequence, the one that ends in the answer the
reward judged; the sequences before it are counted (``agent_breaks``) and not trained on: a
batch holds one row per conversation (``data.train_batch_size x rollout.n``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import ssl
import threading
from collections.abc import Callable
from typing import Any

from ..rollout.common import Example, Rollout
from ..rollout.requests import request_seed
from ..rollout.tokens import token_rollout
from .calls import Call
from .endpoint import INSTALL_HINT, Endpoint
from .render import ChatRenderer
from .sessions import CallRecord, TokenSample, merge_calls
from .trajectory import Trajectory, Turn

__all__ = ["FunctionRunner", "agent_row", "load_agent_function"]

log = logging.getLogger("rlwire.trainer.agent")


def load_agent_function(path: str) -> Callable[..., Any]:
    """The ``async def agent(row, client)`` at dotted path ``path``
    (``package.module:function``).

    Raises:
        ValueError: not such a path, not importable, or not an async function of two
            positional parameters.
    """
    if ":" not in path:
        raise ValueError(
            f"agent.function: {path!r} is not allowed; use a dotted path "
            "'package.module:function' to an async def agent(row, client)"
        )
    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"agent.function: cannot import {path!r}: {err}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"agent.function: {path!r} is not an async function; use async def agent(row, "
            "client) returning the reward or a dict with 'reward'"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(
            f"agent.function: {path!r} does not take (row, client) positionally; use async "
            "def agent(row, client)"
        ) from None
    return fn


def agent_row(example: Example) -> dict[str, Any]:
    """The row an agent is given, in verl's shape: ``prompt`` (chat messages), ``data_source``,
    ``reward_model.ground_truth`` and ``extra_info``."""
    messages = example.messages or [{"role": "user", "content": example.prompt}]
    return {
        "prompt": [dict(m) for m in messages],
        "data_source": example.data_source,
        "reward_model": {"ground_truth": example.answer},
        "extra_info": dict(example.extra_info or {}),
    }


def _reward(value: Any) -> tuple[float | None, dict[str, float]]:
    """The reward and numeric extras an agent returned (a number, or a dict with ``reward``
    or verl's ``score``); None where it gave none that is a finite number."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in ("reward", "score") and _number(item):
                extras[str(key)] = float(item)
        value = value.get("reward", value.get("score"))
    if not _number(value) or not math.isfinite(float(value)):
        return None, extras
    return float(value), extras


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class FunctionRunner:
    """The conversations of ``agent.function`` on one rollout engine; the same calls as
    :class:`~rlwire.trainer.agent.loop.AgentLoop` (``run_async``).

    Args:
        engine: the rollout engine (its ``submit`` serves the endpoint).
        tokenizer: the policy's.
        config: the run's :class:`~rlwire.trainer.config.root.TrainerConfig`.
    """

    def __init__(self, engine, tokenizer, config) -> None:
        from .parsers import parser_class

        agent, rollout = config.agent, config.rollout
        self.fn = load_agent_function(agent.function)
        self.config, self.tokenizer = agent, tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.endpoint = Endpoint(
            engine.submit,
            tokenizer,
            parser_class(agent.format)(),
            temperature=rollout.temperature,
            max_new_tokens=rollout.max_new_tokens,
            timeout=rollout.request_timeout,
            context=engine_context(engine),
            vocabulary=engine_vocabulary(engine),
            **rollout.truncation(),
        )
        self.url = self.endpoint.start(host=agent.endpoint_host)
        self.call_timeout = rollout.request_timeout + 5.0
        self._tls_context: ssl.SSLContext | None = None
        self._tls_lock = threading.Lock()

    def close(self) -> None:
        self.endpoint.stop()

    def run(self, examples: list[Example], n: int, seed: int) -> Rollout:
        return asyncio.run(self.run_async(examples, n, seed))

    async def run_async(
        self, examples: list[Example], n: int, seed: int, *, max_in_flight: int | None = None
    ) -> Rollout:
        """``n`` sessions per example (consecutive), all in flight together (at most
        ``max_in_flight``): one row each, with its trajectory (reward, calls, failure)."""
        room = asyncio.Semaphore(max_in_flight or len(examples) * n)

        async def one(example: Example, seed: int) -> tuple[TokenSample, Trajectory]:
            async with room:
                return await self.session(example, seed)

        done = await asyncio.gather(
            *[
                one(example, request_seed(seed, i * n + j))
                for i, example in enumerate(examples)
                for j in range(n)
            ]
        )
        out = token_rollout(
            self.tokenizer,
            [(s.prompt_ids, s.response_ids, s.logprobs) for s, _ in done],
            masks=[s.mask for s, _ in done],
            versions=[s.versions for s, _ in done],
        )
        out.trajectories = [t for _, t in done]
        return out

    async def session(self, example: Example, seed: int) -> tuple[TokenSample, Trajectory]:
        """One conversation: the agent called on ``example``'s row with a client of a new
        session, to its end, its failure or ``agent.timeout``; its training sequence and
        record."""
        session = self.endpoint.sessions.open(seed)
        call = Call(self._agent, agent_row(example), session.key, name="rlwire-agent")
        timeout = self.config.timeout
        finished, _ = await asyncio.wait({asyncio.wrap_future(call.future)}, timeout=timeout)
        calls = self.endpoint.sessions.close(session)  # a later call of the agent: refused
        reward: float | None = None
        extras: dict[str, float] = {}
        failure: str | None = None
        if not finished:
            call.stop()
            failure = f"ran past agent.timeout ({timeout:g} s)"
        elif call.error is not None:
            failure = f"raised {type(call.error).__name__}: {call.error}"
        else:
            reward, extras = _reward(call.value)
            if reward is None:
                failure = f"returned no finite reward ({_short(call.value)})"
        if failure is None and not calls:
            failure = "made no call to the model"
        sample, record = self._sample(example, calls)
        record.rewards = [0.0 if failure is not None else float(reward or 0.0)]
        record.extras, record.error = extras, failure
        record.stop = "agent_failed" if failure is not None else "agent_returned"
        if failure is not None:
            log.warning(
                "agent.function %s: a session of prompt %r %s", self.config.function,
                _short(example.prompt), failure,
            )  # fmt: skip
        return sample, record

    async def _agent(self, row: dict[str, Any], key: str) -> Any:
        """The user's agent with a client on this run's endpoint and ``key`` (in the call's
        own event loop)."""
        try:
            import openai
        except ImportError as err:
            raise RuntimeError(f"{INSTALL_HINT} ({err})") from None
        # One TLS context for every session's client: httpx builds one per client by default,
        # loading the CA bundle (28 ms here, most of a session's cost on the tiny model);
        # the endpoint is plain HTTP, so it is never used for it, only kept correct.
        http = openai.DefaultAsyncHttpxClient(verify=self._tls(), timeout=self.call_timeout)
        async with openai.AsyncOpenAI(
            base_url=self.url, api_key=key, max_retries=0, timeout=self.call_timeout,
            http_client=http,
        ) as client:  # fmt: skip
            return await self.fn(row, client)

    def _tls(self) -> ssl.SSLContext:
        with self._tls_lock:
            if self._tls_context is None:
                self._tls_context = ssl.create_default_context()
            return self._tls_context

    def _sample(self, example: Example, calls: list[CallRecord]) -> tuple[TokenSample, Trajectory]:
        """The session's trained sequence (its last: see the module's docstring), or the
        example's prompt with no response where it made no call; its record."""
        merged = merge_calls(calls)
        record = Trajectory(calls=len(calls), breaks=merged.breaks)
        if not merged.samples:
            return TokenSample(self.renderer.prompt(example)), record
        sample = merged.samples[-1]
        start = 0
        for end in [*_span_ends(sample.mask), len(sample.mask)]:
            if end > start:
                role = "assistant" if sample.mask[start] else "context"
                text = self.tokenizer.decode(sample.response_ids[start:end])
                record.turns.append(Turn(role, start, end, text))
            start = end
        return sample, record


def _span_ends(mask: list[int]) -> list[int]:
    """The positions where ``mask`` changes value."""
    return [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def engine_vocabulary(engine) -> int | None:
    """The model's vocabulary size (its embedding's rows) as the rollout engine holds it: its
    model's config (``hf``) or vLLM's model config (``vllm``); None where it does not say
    (``vllm_server``: the endpoint then bounds ids by the tokenizer's length alone)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a multimodal model's language model
    llm = getattr(engine, "llm", None)  # vLLM's LLM: its engine's model config
    vllm_config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    vllm_size = getattr(vllm_config, "get_vocab_size", None)
    for value in (getattr(config, "vocab_size", None), vllm_size() if vllm_size else None):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def engine_context(engine) -> int | None:
    """The model's context in tokens as the rollout engine holds it (its model's config,
    or vLLM's ``max_model_len``), or None where it does not say."""
    for value in (
        getattr(engine, "max_model_len", None),
        getattr(
            getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings", None
        ),
    ):
        if isinstance(value, int) and value > 0:
            return value
    return None
