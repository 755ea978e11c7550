"""Requests on a server that batches them itself (``vllm serve``): each request is a chain of
completion calls, many chains in flight at once, with a gate for weight commits.

A :class:`ChainStepper` is the :class:`~rlwire.trainer.rollout.requests.Stepper` of such an
engine. Each live request has at most one completion call in flight (a thread of a pool; the
server batches the concurrent calls continuously), of at most ``chunk_tokens`` new tokens
(None: to the request's end); when it answers, the next call of the chain starts at once.
A step waits for the first answer among those in flight, not for all of them.

The gate: when a utility call (a weight commit) waits in the core
(:meth:`~rlwire.trainer.rollout.requests.EngineCore.calls_waiting`), no new call starts;
the calls in flight end; the core runs the commit once none is in flight
(:meth:`ChainStepper.in_flight`), then the chains go on. Every call runs wholly on one
version of the weights, so each token's version is exact: the version the core held when its
call started.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from .requests import EngineCore, Live, Request, continuation_seed

__all__ = ["ChainStepper", "Complete", "chain_core"]

Complete = Callable[[list[int], int, int, Request], tuple[list[int], list[float], str]]
"""``complete(context_ids, max_tokens, seed, request)``: one completion call (the context is
the request's prompt and the tokens it sampled so far); its sampled token ids, their
log-probs and its finish reason (``stop``: an end-of-sequence token; ``length``: the
call's ``max_tokens`` or the server's own limit)."""


class _Chain:
    """What a chain holds between its calls: how many it made, the one in flight."""

    __slots__ = ("calls", "flight")

    def __init__(self) -> None:
        self.calls = 0
        self.flight: concurrent.futures.Future | None = None


class ChainStepper:
    """Chains of completion calls through ``complete`` (see :data:`Complete`), at most
    ``max_in_flight`` at once; a step waits at most ``timeout`` seconds for an answer."""

    def __init__(
        self,
        complete: Complete,
        *,
        eos: int | None,
        chunk_tokens: int | None,
        max_in_flight: int,
        timeout: float,
        name: str,
    ) -> None:
        self.complete, self.eos, self.chunk_tokens = complete, eos, chunk_tokens
        self.timeout, self.name = timeout, name
        self.core: EngineCore | None = None  # set by chain_core: its gate
        self._pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix=name)
        self._flight: dict[concurrent.futures.Future, tuple[Live, int, int]] = {}

    def in_flight(self) -> bool:
        """Whether a completion call is in flight (the core runs no commit then)."""
        return bool(self._flight)

    def step(self, admitted: list[Live], running: list[Live], version: int) -> None:
        gated = self.core is not None and self.core.calls_waiting()
        if not gated:
            for live in admitted + running:
                if live.state is None:
                    live.state = _Chain()
                if live.state.flight is None:
                    self._launch(live, version)
        if not self._flight:
            return  # gated with nothing in flight: the core runs its commit now
        done, _ = concurrent.futures.wait(
            list(self._flight), timeout=self.timeout, return_when=concurrent.futures.FIRST_COMPLETED
        )
        if not done:
            raise TimeoutError(
                f"{self.name}: no completion call answered within {self.timeout:g} s "
                "(rollout.vllm.request_timeout)"
            )
        for future in done:
            live, called_at, asked = self._flight.pop(future)
            live.state.flight = None
            tokens, logprobs, finish = future.result()  # a failure fails the step's requests
            if len(logprobs) != len(tokens) or len(tokens) > asked:
                raise RuntimeError(
                    f"{self.name}: {len(tokens)} tokens and {len(logprobs)} log-probs for a call "
                    f"of at most {asked} tokens"
                )
            for token, logprob in zip(tokens, logprobs, strict=True):
                live.append(int(token), float(logprob), called_at, self.eos)
                if live.finish_reason is not None:
                    break
            if live.finish_reason is None and (finish == "stop" or len(tokens) < asked):
                live.finish_reason = finish if finish == "stop" else "length"  # the server's end

    def _launch(self, live: Live, version: int) -> None:
        request, chain = live.request, live.state
        asked = request.max_new_tokens - len(live.token_ids)
        if self.chunk_tokens is not None:
            asked = min(asked, self.chunk_tokens)
        seed = continuation_seed(request.seed, chain.calls)
        context = list(request.prompt_ids) + live.token_ids
        chain.calls += 1
        chain.flight = self._pool.submit(self.complete, context, asked, seed, request)
        self._flight[chain.flight] = (live, version, asked)

    def release(self, ended: list[Live]) -> None:
        """Forget the calls of requests that ended (a failed step's): their answers, if any
        come, are dropped."""
        gone = {id(live) for live in ended}
        for future, (live, _, _) in list(self._flight.items()):
            if id(live) in gone:
                del self._flight[future]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def chain_core(
    complete: Complete,
    *,
    eos: int | None,
    config,
    index: int,
    name: str,
) -> EngineCore:
    """An :class:`~rlwire.trainer.rollout.requests.EngineCore` of chains through ``complete``:
    ``rollout.max_num_seqs`` requests at once; with ``async.partial_rollout`` each call of at
    most ``async.partial_rollout_chunk_tokens`` tokens (a commit waits for that many at most),
    else one call per request."""
    chunk = config.async_.partial_rollout_chunk_tokens if config.partial_rollouts() else None
    max_num_seqs = config.rollout.max_num_seqs
    stepper = ChainStepper(
        complete,
        eos=eos,
        chunk_tokens=chunk,
        max_in_flight=max_num_seqs,
        timeout=config.rollout.vllm.request_timeout + 30.0,
        name=f"rlwire-{name}-{index}",
    )
    core = EngineCore(stepper, max_num_seqs=max_num_seqs, name=f"rlwire-{name}-{index}")
    stepper.core = core
    return core
