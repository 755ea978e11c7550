"""The agent loop: ``rollout.n`` conversations per prompt on a rollout engine, turn by turn.

Every model turn of the live conversations is one batched call of the engine's
``extend`` (:class:`~rlwire.trainer.rollout.PartialRolloutEngine`: token ids in, sampled
token ids and their behaviour log-probs out), in chunks with partial rollouts; then every
conversation's environment answers at once (each step in a thread of its own, bounded by
``agent.tool_timeout``), and its answer's tokens (:meth:`ChatRenderer.turn`) are appended.
The response the trainer gets is every token after the prompt: the model's exactly as
sampled (loss mask 1, behaviour log-prob and weight version each) and the environment's and
template's (mask 0, log-prob 0)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..rollout.common import Example, Rollout
from .environment import Environment, Observation, as_observation
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


def _rows(contexts: list[list[int]], pad: int) -> Rollout:
    """Token lists as a batch of prompts (left-padded) with empty responses, for ``extend``."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[row, width - len(context) :] = 1
    empty = ids.new_zeros((len(contexts), 0))
    return Rollout(ids, mask, empty, empty.clone(), empty.float(), [""] * len(contexts), pad_id=pad)


class AgentLoop:
    """Multi-turn generation on a :class:`~rlwire.trainer.rollout.PartialRolloutEngine`.

    Args:
        engine: the rollout engine (its ``extend`` samples).
        tokenizer: the model's (decodes each model turn for the environment).
        renderer: the prompts' and environment turns' tokens.
        environment: builds one environment per conversation.
        config: the ``agent`` section.
        max_tokens: the whole response's budget (``rollout.max_new_tokens``).
    """

    def __init__(
        self,
        engine,
        tokenizer,
        renderer: ChatRenderer,
        environment: Callable[[], Environment],
        config,
        max_tokens: int,
    ) -> None:
        self.engine, self.tokenizer, self.renderer = engine, tokenizer, renderer
        self.environment, self.config, self.max_tokens = environment, config, max_tokens

    def run(
        self,
        examples: list[Example],
        n: int,
        seed: int,
        *,
        version: Callable[[], int],
        chunk: int | None = None,
        between: Callable[[], None] | None = None,
    ) -> Rollout:
        """``n`` conversations per example (consecutive): a :class:`Rollout` whose
        ``response_mask`` is the loss mask and whose ``trajectories`` are their records.
        ``chunk``: tokens per engine call (partial rollouts), with ``between()`` (a weight
        sync, if one is requested) between two calls; ``version()``: the weights' version
        now, stamped on each model token."""
        everyone = []
        for example in examples:
            prompt = self.renderer.prompt(example)
            for _ in range(n):
                env = self.environment()
                env.reset(example)
                everyone.append(Conversation(prompt, env))
        live, calls = list(everyone), 0
        while live:
            calls = self._model_turn(live, seed, calls, version, chunk, between)
            self._environment_turn([c for c in live if not c.record.stop], version())
            live = [c for c in live if not c.record.stop]
        return self._batch(everyone)

    def _model_turn(self, live, seed: int, calls: int, version, chunk, between) -> int:
        """One model turn for every live conversation (in chunks of ``chunk`` tokens, with
        ``between()`` between them): each row gets what the engine sampled, cut at its
        own budget; a turn that did not end with end-of-sequence stops its conversation
        (``length``). Returns the engine calls made so far (the seeds' counter)."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        pending = list(live)
        for conv in pending:
            conv.turn = ([], [], [])
        while pending:
            left = [self.max_tokens - len(c.ids) - len(c.turn[0]) for c in pending]
            size = max(left) if chunk is None else min(chunk, max(left))
            batch = _rows([c.prompt + c.ids + c.turn[0] for c in pending], pad)
            grown, ended = self.engine.extend(batch, size, seed + calls * 7_919)
            calls += 1
            now = version()
            still = []
            for row, conv in enumerate(pending):
                real = grown.response_mask[row].bool()
                ids = grown.response_ids[row][real].tolist()[: left[row]]
                logprobs = grown.logprobs[row][real].tolist()[: len(ids)]
                conv.turn[0].extend(ids)
                conv.turn[1].extend(logprobs)
                conv.turn[2].extend([now] * len(ids))
                finished = (ids and ids[-1] == eos) or len(ids) >= left[row] or bool(ended[row])
                if not finished:
                    still.append(conv)
            pending = still
            if pending and between is not None:
                between()
        for conv in live:
            ids, logprobs, versions = conv.turn
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            conv.add(ids, logprobs, versions, "assistant", text)
            if not ids or ids[-1] != eos:
                conv.record.stop = "length"
            elif conv.record.assistant_turns == self.config.max_assistant_turns:
                conv.record.stop = "max_assistant_turns"
        return calls

    def _environment_turn(self, live: list[Conversation], version: int) -> None:
        """Every live conversation's environment answers its last model turn, all at once;
        the answers' tokens are appended, or the conversation stops."""
        for conv in live:  # at the limit: the environment is not asked again
            if conv.user_turns == self.config.max_user_turns:
                conv.record.stop = "max_user_turns"
        live = [c for c in live if not c.record.stop]
        if not live:
            return
        answers = self._step_all(live)
        for conv, answer in zip(live, answers, strict=True):
            record = conv.record
            if isinstance(answer, str):  # the environment failed: the conversation ends
                record.stop, record.error = "error", answer
                continue
            record.tool_results += answer.tool_results
            record.dropped_calls += answer.dropped_calls
            record.rewards.append(answer.reward)
            if answer.done or not answer.messages:
                record.stop = "done" if answer.done else "no_call"
                continue
            ids = self.renderer.turn(answer.messages)
            if len(conv.ids) + len(ids) >= self.max_tokens:  # no room left for a model token
                record.stop = "length"
                continue
            conv.user_turns += 1
            role = answer.messages[0].get("role", "user")
            text = "\n".join(str(m.get("content", "")) for m in answer.messages)
            conv.add(ids, None, [version] * len(ids), role, text)

    def _step_all(self, live: list[Conversation]) -> list[Observation | str]:
        """Each conversation's environment step on its last model turn, each in a daemon
        thread, all bounded together by ``agent.tool_timeout`` (plus a second for the
        tools' environment, whose calls are bounded by it already); a step that fails or
        does not answer in time is its error message."""
        boxes: list[dict[str, Any]] = [{} for _ in live]
        events = [threading.Event() for _ in live]

        def step(conv: Conversation, box: dict[str, Any], event: threading.Event) -> None:
            try:
                box["value"] = as_observation(conv.env.step(conv.record.turns[-1].text))
            except BaseException as err:  # noqa: BLE001 - reported as the trajectory's error
                box["error"] = f"environment step raised {type(err).__name__}: {err}"
            event.set()

        for conv, box, event in zip(live, boxes, events, strict=True):
            threading.Thread(target=step, args=(conv, box, event), daemon=True).start()
        deadline = time.perf_counter() + self.config.tool_timeout + 1.0
        answers: list[Observation | str] = []
        for box, event in zip(boxes, events, strict=True):
            if not event.wait(max(0.0, deadline - time.perf_counter())):
                timeout = self.config.tool_timeout
                answers.append(f"environment step did not answer within {timeout:g} s")
            elif "error" in box:
                answers.append(box["error"])
            else:
                answers.append(box["value"])
        return answers

    def _batch(self, conversations: list[Conversation]) -> Rollout:
        """The conversations as one batch (prompts left-padded, responses right-padded)."""
        pad = self.tokenizer.pad_token_id
        rows = len(conversations)
        width_p = max(len(c.prompt) for c in conversations)
        width_r = max(1, max(len(c.ids) for c in conversations))
        prompt_ids = torch.full((rows, width_p), pad, dtype=torch.long)
        prompt_mask = torch.zeros((rows, width_p), dtype=torch.long)
        response_ids = torch.full((rows, width_r), pad, dtype=torch.long)
        mask = torch.zeros((rows, width_r), dtype=torch.long)
        logprobs = torch.zeros((rows, width_r), dtype=torch.float32)
        versions = torch.zeros((rows, width_r), dtype=torch.long)
        for row, conv in enumerate(conversations):
            p, t = len(conv.prompt), len(conv.ids)
            prompt_ids[row, width_p - p :] = torch.tensor(conv.prompt, dtype=torch.long)
            prompt_mask[row, width_p - p :] = 1
            response_ids[row, :t] = torch.tensor(conv.ids, dtype=torch.long)
            mask[row, :t] = torch.tensor(conv.mask, dtype=torch.long)
            logprobs[row, :t] = torch.tensor(conv.logprobs, dtype=torch.float32)
            versions[row, :t] = torch.tensor(conv.versions, dtype=torch.long)
        texts = [self.tokenizer.decode(c.ids, skip_special_tokens=True) for c in conversations]
        return Rollout(
            prompt_ids,
            prompt_mask,
            response_ids,
            mask,
            logprobs,
            texts,
            pad_id=pad,
            versions=versions,
            trajectories=[c.record for c in conversations],
        )


def build_loop(config, engine, model_path: str) -> AgentLoop:
    """The agent loop of a rollout worker: ``config.agent``'s tools or environment on
    ``engine`` (its ``tokenizer``, else the model directory's)."""
    from .environment import ToolEnvironment, environment_class
    from .parsers import parser_class
    from .tools import ToolRunner, load_tools

    agent = config.agent
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    tools = load_tools(agent.tools)
    if agent.environment is not None:
        environment: Callable[[], Environment] = environment_class(agent.environment)
    else:
        runner = ToolRunner(tools, agent.tool_timeout, agent.max_tool_response_length)
        parser = parser_class(agent.format)()

        def environment() -> Environment:
            return ToolEnvironment(runner, parser, agent.max_parallel_calls)

    renderer = ChatRenderer(tokenizer, [t.schema for t in tools])
    return AgentLoop(engine, tokenizer, renderer, environment, agent, config.rollout.max_new_tokens)
