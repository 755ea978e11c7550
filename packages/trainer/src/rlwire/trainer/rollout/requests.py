"""Request-level rollout: one request is one continuation, and an engine core serves many at
once, admitting new ones between two decoding steps (continuous batching).

A :class:`Request` carries prompt token ids and its own sampling settings and seed; its
:class:`Completion` carries the sampled token ids, their behaviour log-probs and, per
token, the weight version that produced it. Callers submit requests at any time to an
:class:`EngineCore` and get a :class:`concurrent.futures.Future` each (``asyncio`` callers
wrap it with :func:`asyncio.wrap_future`); batching is the core's business.

The core is one loop in a thread of its own, the shape of vLLM's v1 engine core: run the
utility calls queued since the last step (a weight commit: :meth:`EngineCore.call`), admit
waiting requests up to ``max_num_seqs``, advance every live request by one step of its
:class:`Stepper`, answer those that finished. A weight update is a utility call: it runs
between two decoding steps and every request in flight carries on with the new weights
(its later tokens stamped with the new version); nothing is aborted.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "Completion",
    "EngineCore",
    "Live",
    "Request",
    "Stepper",
    "continuation_seed",
    "request_seed",
    "sample_requests",
    "wait_all",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One continuation: ``prompt_ids`` (the whole context: prompt and earlier turns) in,
    up to ``max_new_tokens`` sampled tokens out, from ``softmax(logits / temperature)``
    (cut to its ``top_k`` most likely tokens and to its ``top_p`` nucleus when they are set,
    then renormalised: the log-probs are that distribution's) with a generator seeded by
    ``seed`` (the same request gives the same tokens whatever else is in the batch, up to
    the batch's floating-point noise), or the most likely token with ``greedy`` (log-probs
    then at temperature 1)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    seed: int
    greedy: bool = False
    request_id: str = ""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches
    it (1.0: off)."""
    top_k: int = 0
    """The most likely tokens kept (0: off)."""

    @property
    def truncated(self) -> bool:
        """Whether ``top_p`` or ``top_k`` cuts the distribution."""
        return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("Request.prompt_ids: empty; a request needs at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens: {self.max_new_tokens}; use an int >= 1")
        if not self.temperature > 0:
            raise ValueError(f"Request.temperature: {self.temperature}; use a float > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Request.top_p: {self.top_p}; use a float in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"Request.top_k: {self.top_k}; use an int >= 0 (0: off)")


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """What the engine sampled for one :class:`Request`: ``token_ids`` (up to and including
    an end-of-sequence token), each token's behaviour log-prob and weight version, and why
    it ended (``stop``: end-of-sequence; ``length``: ``max_new_tokens``)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


class Live:
    """A request being served: what it sampled so far. A :class:`Stepper` appends to it and
    sets ``finish_reason`` when it ends; it may keep its own state in ``state``."""

    __slots__ = ("future", "finish_reason", "logprobs", "request", "state", "token_ids", "versions")

    def __init__(self, request: Request, future: concurrent.futures.Future) -> None:
        self.request, self.future = request, future
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.state: Any = None

    def append(self, token: int, logprob: float, version: int, eos: int | None) -> None:
        """One sampled token; ends the request on ``eos`` or at ``max_new_tokens``."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if eos is not None and token == eos:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.request.max_new_tokens:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        assert self.finish_reason is not None, "Live.completion: the request has not ended"
        return Completion(
            self.request.request_id,
            self.token_ids,
            self.logprobs,
            self.versions,
            self.finish_reason,
        )


class Stepper(Protocol):
    """The model-specific half of an engine core (``hf``'s KV-cached batch; a lock-step
    engine's ``extend`` call)."""

    def step(self, admitted: list[Live], running: list[Live], version: int) -> None:
        """Advance every request by at least one token (``admitted``: joining now; ``running``:
        admitted at an earlier step and not ended), stamping ``version`` on the new
        tokens; a request that ends sets its ``finish_reason``."""

    def release(self, ended: list[Live]) -> None:
        """Forget what the stepper holds for requests that ended (their cache rows)."""

    # Optional: ``in_flight() -> bool``, whether work the stepper started is still running
    # outside a step (a server's calls: :mod:`.chains`), the core running no utility call
    # then; ``close()``, called as the core closes.


class EngineCore:
    """Serves :class:`Request` s on a :class:`Stepper` in a thread of its own.

    Args:
        stepper: advances the live requests.
        max_num_seqs: requests decoded together at most (vLLM's ``max_num_seqs``); more
            wait and join as others end.
        name: the thread's name (for stack dumps).
    """

    def __init__(self, stepper: Stepper, *, max_num_seqs: int, name: str = "rlwire-engine") -> None:
        if max_num_seqs < 1:
            raise ValueError(f"EngineCore.max_num_seqs: {max_num_seqs}; use an int >= 1")
        self.stepper, self.max_num_seqs, self.name = stepper, max_num_seqs, name
        self.version = 0
        """The weight version stamped on every token sampled now (utility calls set it)."""
        self._cond = threading.Condition()
        self._waiting: collections.deque[Live] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._running: list[Live] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._stepping: list[Live] = []  # the requests of the step in progress
        self.steps = 0
        """Decoding steps run so far (each advances every live request)."""
        self.busy_s = 0.0
        """Wall seconds spent in steps so far (the engine's own time: what a benchmark's
        bound on samples/s is made of)."""

    # --- the callers' side -------------------------------------------------------------
    def submit(self, request: Request) -> concurrent.futures.Future:
        """Queue ``request``; a future of its :class:`Completion` (or of the error that
        ended it). Joins the running batch at the next step with room."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[Request]) -> list[concurrent.futures.Future]:
        """Queue ``requests`` together: the same step admits them (as room allows), so a
        call's batches, and so its log-probs to the last bit, do not depend on thread
        timing."""
        lives = []
        for request in requests:
            if not request.request_id:
                request = dataclasses.replace(request, request_id=f"req-{next(self._ids)}")
            lives.append(Live(request, concurrent.futures.Future()))
        with self._cond:
            if self._closed:
                raise self._failure or RuntimeError(f"{self.name}: closed; no request is taken")
            self._waiting.extend(lives)
            self._start()
            self._cond.notify_all()
        return [live.future for live in lives]

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` in the core's thread between two decoding steps (a weight commit);
        a future of its result. A result that is an int becomes :attr:`version`: the
        tokens sampled after it carry it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise self._failure or RuntimeError(f"{self.name}: closed; no call is taken")
            self._calls.append((fn, future))
            self._start()
            self._cond.notify_all()
        return future

    def calls_waiting(self) -> bool:
        """Whether a utility call waits for the next step boundary (a stepper with work in
        flight starts no more: :mod:`.chains`)."""
        with self._cond:
            return bool(self._calls)

    def fail(self, err: BaseException) -> None:
        """End the core at once, from any thread: every request and call not answered fails
        with ``err`` now (not after the step in progress), and so does every later submit;
        the answers of that step, if they come, are dropped (the engine is gone:
        :class:`~rlwire.trainer.rollout.base.EngineLost`)."""
        with self._cond:
            self._closed = True
            self._failure = err
            self._fail_all(err)
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop once the step in progress ends; what was not answered fails; then
        the stepper's own ``close``, if it has one (its threads)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        stepper_close = getattr(self.stepper, "close", None)
        if stepper_close is not None:
            stepper_close()

    # --- the loop ----------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or self._calls or self._waiting or self._running
                )
                if self._closed:
                    self._fail_all(RuntimeError(f"{self.name}: closed before it answered"))
                    return
                calls: list = []
                if not self._stepper_in_flight():  # else after the work in flight ends
                    calls, self._calls = list(self._calls), collections.deque()
            for fn, future in calls:  # between two steps: the batch is not in a forward
                self._run_call(fn, future)
            with self._cond:  # then the requests that wait, as room allows
                room = self.max_num_seqs - len(self._running)
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                running = list(self._running)
            admitted = [live for live in admitted if _begin(live.future)]
            if not admitted and not running:
                continue
            with self._cond:
                self._stepping = admitted + running  # (fail() answers them at once)
            began = time.perf_counter()
            try:
                self.stepper.step(admitted, running, self.version)
            except BaseException as err:  # noqa: BLE001 - every request in it fails with it
                self.stepper.release(admitted + running)
                with self._cond:
                    self._running = []
                for failed in admitted + running:
                    _settle(failed.future, err)
                continue
            self.steps += 1
            self.busy_s += time.perf_counter() - began
            stepped = admitted + running
            ended = [r for r in stepped if r.finish_reason is not None]
            if ended:
                self.stepper.release(ended)
            with self._cond:
                self._running = [r for r in stepped if r.finish_reason is None]
            for r in ended:
                _settle(r.future, r.completion())

    def _stepper_in_flight(self) -> bool:
        in_flight = getattr(self.stepper, "in_flight", None)
        return bool(in_flight()) if in_flight is not None else False

    def _run_call(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not _begin(future):
            return
        try:
            result = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            _settle(future, err)
            return
        if isinstance(result, int) and not isinstance(result, bool):
            self.version = result
        _settle(future, result)

    def _fail_all(self, err: BaseException) -> None:
        """Lock held: every request and call not answered fails with ``err``."""
        for live in [*self._waiting, *self._running, *self._stepping]:
            _settle(live.future, err)
        for _, future in self._calls:
            if not future.done():
                future.set_exception(err)
        self._waiting.clear()
        self._running = self._stepping = []
        self._calls.clear()


def _begin(future: concurrent.futures.Future) -> bool:
    """Mark ``future`` running; False if it was cancelled or :meth:`EngineCore.fail` answered
    it already."""
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # answered meanwhile (failed): not to run
        return False


def _settle(future: concurrent.futures.Future, outcome: Any) -> None:
    """Answer ``future`` with ``outcome`` (an error is raised to its waiter) unless
    :meth:`EngineCore.fail` answered it already (the engine is gone: this answer, which
    came after, is dropped)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def wait_all(futures: list[concurrent.futures.Future], timeout: float, what: str) -> list:
    """Every future's result, each waited for at most ``timeout`` seconds (counted per
    request, from this call); the first failure is raised."""
    deadline = time.monotonic() + timeout
    results = []
    for future in futures:
        try:
            results.append(future.result(max(0.0, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{what}: a request was not answered within {timeout:g} s (rollout.request_timeout)"
            ) from None
    return results


def sample_requests(
    rows: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    greedy: bool,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[Request]:
    """One :class:`Request` per row of prompt token ids, row ``i`` seeded
    ``request_seed(seed, i)`` (greedy ones at temperature 1, whatever ``temperature``)."""
    temperature = 1.0 if greedy else temperature
    return [
        Request(
            tuple(ids),
            max_new_tokens,
            temperature,
            request_seed(seed, row),
            greedy=greedy,
            top_p=top_p,
            top_k=top_k,
        )
        for row, ids in enumerate(rows)
    ]


def continuation_seed(seed: int, k: int) -> int:
    """The seed of a request's ``k``-th continuation (a server call, a re-admission, a
    lock-step call): its own ``seed`` for ``k = 0``, distinct streams after."""
    return (seed + k * 7_919) % (2**63)


def request_seed(seed: int, row: int) -> int:
    """Row ``row``'s seed of a call seeded ``seed`` (distinct rows, distinct streams)."""
    return (seed * 1_000_003 + row) % (2**63)
