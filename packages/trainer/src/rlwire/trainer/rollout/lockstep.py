"""Requests over a lock-step engine: a :class:`~rlwire.trainer.rollout.requests.Stepper`
whose step is one ``extend`` call (:class:`~rlwire.trainer.rollout.base.PartialRolloutEngine`)
over every live request, each cut at its own budget.

It gives an engine that generates in batches the request interface (the agent loop and the
rollout worker speak only requests), not continuous batching within a call: a request that
arrives during a call joins the next one, and a call's requests share one seed. Weight
commits run between two calls (:meth:`~rlwire.trainer.rollout.requests.EngineCore.call`).
"""

from __future__ import annotations

from .requests import EngineCore, Live, continuation_seed
from .tokens import Row, token_rollout

__all__ = ["LockstepStepper", "lockstep_core"]


class LockstepStepper:
    """One ``engine.extend`` per step over every live request (those joining and those
    running), each advanced by at most ``chunk_tokens`` tokens (None: to its end), so that
    weight commits land every ``chunk_tokens`` tokens at most (partial rollouts)."""

    def __init__(self, engine, chunk_tokens: int | None = None) -> None:
        self.engine, self.chunk_tokens = engine, chunk_tokens
        self.calls = 0

    def step(self, admitted: list[Live], running: list[Live], version: int) -> None:
        live = running + admitted
        tokenizer = self.engine.tokenizer
        eos = tokenizer.eos_token_id
        contexts: list[Row] = [(list(r.request.prompt_ids) + r.token_ids, [], []) for r in live]
        rows = token_rollout(tokenizer, contexts)  # prompts with empty responses
        budget = max(r.request.max_new_tokens - len(r.token_ids) for r in live)
        if self.chunk_tokens is not None:
            budget = min(budget, self.chunk_tokens)
        grown, _ = self.engine.extend(
            rows, budget, continuation_seed(live[0].request.seed, self.calls)
        )
        self.calls += 1
        for row, request in enumerate(live):
            real = grown.response_mask[row].bool()
            tokens = grown.response_ids[row][real].tolist()
            logprobs = grown.logprobs[row][real].tolist()
            for token, logprob in zip(tokens, logprobs, strict=True):
                request.append(int(token), float(logprob), version, eos)
                if request.finish_reason is not None:
                    break
            if request.finish_reason is None and len(tokens) < budget:
                request.finish_reason = "length"  # the engine stopped early (its own limit)

    def release(self, ended: list[Live]) -> None:
        """Nothing to forget: each call is given every live request's whole context, and the
        stepper keeps nothing per request between calls."""


def lockstep_core(engine) -> EngineCore:
    """The request core of a lock-step ``engine``: ``rollout.max_num_seqs`` per call, and
    with ``async.partial_rollout`` at most ``async.partial_rollout_chunk_tokens`` tokens."""
    config = engine.config
    chunk = config.async_.partial_rollout_chunk_tokens if config.partial_rollouts() else None
    return EngineCore(
        LockstepStepper(engine, chunk),
        max_num_seqs=config.rollout.max_num_seqs,
        name=f"rlwire-lockstep-{engine.index}",
    )
