"""The agent loop: ``rollout.n`` conversations per prompt on a rollout engine, each its own
task.

Every conversation is an ``asyncio`` task: a model turn is one request to the engine
(:meth:`~rlwire.trainer.rollout.RolloutEngine.submit`: token ids in, sampled token ids with
their behaviour log-probs and weight versions out), and its environment step (the tool
calls) runs in a thread of its own (:class:`~rlwire.trainer.agent.calls.Call`) while the
other conversations generate; a finished turn's tool starts at once, not when the slowest
conversation's turn ends. The environment's answer's tokens (:meth:`ChatRenderer.turn`)
are appended and the next turn is requested. The response the trainer gets is every token
after the prompt: the model's exactly as sampled (loss mask 1, behaviour log-prob and
weight version each) and the environment's and template's (mask 0, log-prob 0)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..rollout.common import Example, Rollout
from ..rollout.requests import Completion, Request, request_seed
from ..rollout.tokens import token_rollout
from .calls import Call
from .environment import Environment, Observation, as_observation
from .function import FunctionRunner
from .render import ChatRenderer
from .trajectory import Trajectory, Turn

__all__ = ["AgentLoop", "Conversation"]


class Conversation:
    """One trajectory being generated: its prompt and response tokens, loss mask,
    behaviour log-probs and versions, its environment and record."""

    def __init__(self, prompt: list[int], env: Environment) -> None:
        self.prompt, self.env = prompt, env
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.record = Trajectory()
        self.user_turns = 0
        # the model turn being sampled: its tokens, log-probs and versions so far
        self.turn: tuple[list[int], list[float], list[int]] = ([], [], [])

    def add(
        self,
        ids: list[int],
        logprobs: list[float] | None,
        versions: list[int],
        role: str,
        text: str,
    ) -> None:
        """Append a turn: the model's with its ``logprobs`` (mask 1), else mask 0."""
        start = len(self.ids)
        model = logprobs is not None
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions
        self.record.turns.append(Turn(role, start, len(self.ids), text))


class AgentLoop:
    """Multi-turn generation on a rollout engine that takes requests.

    Args:
        engine: the rollout engine (its ``submit``).
        tokenizer: the model's (decodes each model turn for the environment).
        renderer: the prompts' and environment turns' tokens.
        environment: builds one environment per conversation.
        config: the ``agent`` section.
        max_tokens: the whole response's budget (``rollout.max_new_tokens``).
        temperature: the sampling temperature (``rollout.temperature``).
        request_timeout: seconds one model turn may take (``rollout.request_timeout``).
    """

    def __init__(
        self,
        engine,
        tokenizer,
        renderer: ChatRenderer,
        environment: Callable[[], Environment],
        config,
        max_tokens: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        request_timeout: float = 600.0,
    ) -> None:
        self.engine, self.tokenizer, self.renderer = engine, tokenizer, renderer
        self.environment, self.config, self.max_tokens = environment, config, max_tokens
        self.temperature, self.request_timeout = temperature, request_timeout
        self.top_p, self.top_k = top_p, top_k

    def run(self, examples: list[Example], n: int, seed: int) -> Rollout:
        """``n`` conversations per example (consecutive), all in flight together: a
        :class:`Rollout` whose ``response_mask`` is the loss mask, ``versions`` the weight
        version of each model token and ``trajectories`` the conversations' records."""
        return asyncio.run(self.run_async(examples, n, seed))

    async def run_async(
        self, examples: list[Example], n: int, seed: int, *, max_in_flight: int | None = None
    ) -> Rollout:
        """:meth:`run` in the running event loop; ``max_in_flight``: conversations in flight
        at most (None: all), the next starting as one ends."""
        room = asyncio.Semaphore(max_in_flight or len(examples) * n)

        async def one(example: Example, seed: int) -> Conversation:
            async with room:
                return await self.converse(example, seed)

        tasks = [
            one(example, request_seed(seed, i * n + j))
            for i, example in enumerate(examples)
            for j in range(n)
        ]
        return self._batch(list(await asyncio.gather(*tasks)))

    async def converse(self, example: Example, seed: int) -> Conversation:
        """One conversation to its end: model turn, environment turn, and so on."""
        env = self.environment()
        env.reset(example)
        conv = Conversation(self.renderer.prompt(example), env)
        record = conv.record
        while True:
            done = await self._model_turn(conv, request_seed(seed, record.assistant_turns))
            if done.finish_reason != "stop":
                record.stop = "length"
            elif record.assistant_turns == self.config.max_assistant_turns:
                record.stop = "max_assistant_turns"
            elif conv.user_turns == self.config.max_user_turns:
                record.stop = "max_user_turns"  # at the limit: the environment is not asked
            else:
                self._environment_turn(conv, await self._step(conv), done.versions[-1])
            if record.stop:
                return conv

    async def _model_turn(self, conv: Conversation, seed: int) -> Completion:
        """The model's next turn, sampled to its end or to the response's budget."""
        request = Request(
            tuple(conv.prompt + conv.ids),
            self.max_tokens - len(conv.ids),
            self.temperature,
            seed,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        future = self.engine.submit(request)
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(future), self.request_timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"agent loop: a model turn was not answered within {self.request_timeout:g} s "
                "(rollout.request_timeout)"
            ) from None
        text = self.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        conv.add(done.token_ids, done.logprobs, done.versions, "assistant", text)
        return done

    async def _step(self, conv: Conversation) -> Observation | str:
        """The environment's step on the last model turn, in a thread of its own, bounded by
        ``agent.tool_timeout`` (plus a second for the tools' environment, whose calls are
        bounded by it already); a step that fails or does not answer in time is its error
        message (and the thread is stopped)."""
        call = Call(conv.env.step, conv.record.turns[-1].text, name="rlwire-environment-step")
        timeout = self.config.tool_timeout
        ended = asyncio.wrap_future(call.future)  # never cancelled: waited on, not owned
        finished, _ = await asyncio.wait({ended}, timeout=timeout + 1.0)
        if not finished:
            call.stop()
            return f"environment step did not answer within {timeout:g} s"
        if call.error is not None:
            err = call.error
            return f"environment step raised {type(err).__name__}: {err}"
        try:
            return as_observation(call.value)
        except BaseException as err:  # noqa: BLE001 - reported as the trajectory's error
            return f"environment step raised {type(err).__name__}: {err}"

    def _environment_turn(
        self, conv: Conversation, answer: Observation | str, version: int
    ) -> None:
        """The environment's ``answer``'s tokens appended, or the conversation stopped."""
        record = conv.record
        if isinstance(answer, str):  # the environment failed: the conversation ends
            record.stop, record.error = "error", answer
            return
        record.tool_results += answer.tool_results
        record.dropped_calls += answer.dropped_calls
        record.rewards.append(answer.reward)
        if answer.done or not answer.messages:
            record.stop = "done" if answer.done else "no_call"
            return
        ids = self.renderer.turn(answer.messages)
        if len(conv.ids) + len(ids) >= self.max_tokens:  # no room left for a model token
            record.stop = "length"
            return
        conv.user_turns += 1
        role = answer.messages[0].get("role", "user")
        text = "\n".join(str(m.get("content", "")) for m in answer.messages)
        conv.add(ids, None, [version] * len(ids), role, text)

    def _batch(self, conversations: list[Conversation]) -> Rollout:
        """The conversations as one batch (prompts left-padded, responses right-padded), with
        their loss masks, versions and records."""
        out = token_rollout(
            self.tokenizer,
            [(c.prompt, c.ids, c.logprobs) for c in conversations],
            masks=[c.mask for c in conversations],
            versions=[c.versions for c in conversations],
        )
        out.trajectories = [c.record for c in conversations]
        return out


def build_loop(config, engine, model_path: str) -> AgentLoop | FunctionRunner:
    """The agent loop of a rollout worker: ``config.agent``'s tools or environment on
    ``engine`` (its ``tokenizer``, else the model directory's), or its ``function``'s
    sessions through an endpoint on ``engine``."""
    from .environment import ToolEnvironment, environment_class
    from .parsers import parser_class
    from .tools import ToolRunner, load_tools

    agent = config.agent
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    if agent.function is not None:
        return FunctionRunner(engine, tokenizer, config)
    tools = load_tools(agent.tools)
    if agent.environment is not None:
        environment: Callable[[], Environment] = environment_class(agent.environment)
    else:
        runner = ToolRunner(tools, agent.tool_timeout, agent.max_tool_response_length)
        parser = parser_class(agent.format)()

        def environment() -> Environment:
            return ToolEnvironment(runner, parser, agent.max_parallel_calls)

    renderer = ChatRenderer(tokenizer, [t.schema for t in tools])
    rollout = config.rollout
    return AgentLoop(
        engine,
        tokenizer,
        renderer,
        environment,
        agent,
        rollout.max_new_tokens,
        temperature=rollout.temperature,
        request_timeout=rollout.request_timeout,
        **rollout.truncation(),
    )
