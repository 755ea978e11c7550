"""Request-level rollout: the engine core, the ``hf`` continuous batch (requests joining
mid-batch, weight updates between two decoding steps), the lock-step core over ``extend``,
and conversations that never wait for each other."""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time

import pytest
import torch

from rlwire.trainer.algorithms.step import compute_old_logprobs
from rlwire.trainer.models.tiny import build_tiny_model
from rlwire.trainer.rollout.hf_batch import HFBatch
from rlwire.trainer.rollout.lockstep import LockstepStepper
from rlwire.trainer.rollout.requests import EngineCore, Request, wait_all
from rlwire.trainer.rollout.tokens import completions_rollout

PROMPTS = ["a:", "bcd:", "e:", "fghij:", "k:", "lm:"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("requests") / "tiny")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _core(model, tokenizer, max_num_seqs: int) -> EngineCore:
    batch = HFBatch(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    return EngineCore(batch, max_num_seqs=max_num_seqs)


def _serve(
    core: EngineCore, rows: list[list[int]], *, temperature=0.9, new=12, greedy=False, **cut
):
    """The rows' requests, all waiting when the core takes its first step (it is held by a
    call until they are queued). ``cut``: ``top_p``, ``top_k``."""
    requests = [
        Request(tuple(r), new, temperature, seed=100 + i, greedy=greedy, **cut)
        for i, r in enumerate(rows)
    ]
    queued = threading.Event()
    held = core.call(lambda: queued.wait(30))
    futures = [core.submit(r) for r in requests]
    queued.set()
    assert held.result(30) is True
    return wait_all(futures, 60, "test")


def _rows(tokenizer, prompts=PROMPTS) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def _recomputed(model, tokenizer, rows, done, temperature):
    out = completions_rollout(tokenizer, rows, done)
    logp = compute_old_logprobs(model, out, micro_batch_size=8, temperature=temperature)
    return out, logp


def test_requests_joining_mid_batch_get_the_actors_logprobs_and_their_own_tokens(tiny):
    """Six requests through a batch of at most three: the later ones join as earlier ones
    end. Each gets exactly the tokens it gets alone (its own seed), and its behaviour
    log-probs are the actor's recomputation of those tokens."""
    model, tokenizer = tiny
    rows = _rows(tokenizer)
    core = _core(model, tokenizer, max_num_seqs=3)
    done = _serve(core, rows)
    alone = _serve(_core(model, tokenizer, max_num_seqs=1), rows)
    assert [d.token_ids for d in done] == [a.token_ids for a in alone]
    lengths = [len(d.token_ids) for d in done]
    assert len(set(lengths)) > 1  # some ended early: the others joined mid-batch
    assert core.steps < sum(lengths)  # and they were decoded together
    for d in done:
        assert (d.finish_reason == "stop") == (d.token_ids[-1] == tokenizer.eos_token_id)
        assert d.finish_reason == "stop" or len(d.token_ids) == 12
        assert set(d.versions) == {0}
    out, recomputed = _recomputed(model, tokenizer, rows, done, 0.9)
    mask = out.response_mask.bool()
    torch.testing.assert_close(out.logprobs[mask], recomputed[mask], atol=1e-5, rtol=0)


def test_greedy_requests_take_the_most_likely_token_at_temperature_one(tiny):
    model, tokenizer = tiny
    rows = _rows(tokenizer)[:3]
    done = _serve(_core(model, tokenizer, 4), rows, greedy=True, temperature=0.3)
    out, recomputed = _recomputed(model, tokenizer, rows, done, 1.0)
    mask = out.response_mask.bool()
    torch.testing.assert_close(out.logprobs[mask], recomputed[mask], atol=1e-5, rtol=0)
    # the first token is the argmax of the prompt's next-token distribution
    first = model(input_ids=torch.tensor([rows[0]])).logits[0, -1].argmax()
    assert done[0].token_ids[0] == int(first)


def test_top_k_and_top_p_cut_the_distribution_sampled_and_its_logprobs(tiny):
    from rlwire.trainer.rollout.hf_batch import truncated

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    asked = [
        Request((1,), 1, 1.0, seed=0, top_k=2),
        Request((1,), 1, 1.0, seed=0, top_p=0.7),
        Request((1,), 1, 1.0, seed=0, top_p=0.45),
        Request((1,), 1, 1.0, seed=0),
    ]
    cut = truncated(probs.log(), asked).exp()
    expected = [[0.625, 0.375, 0, 0], [0.625, 0.375, 0, 0], [1, 0, 0, 0], [0.5, 0.3, 0.15, 0.05]]
    torch.testing.assert_close(cut, torch.tensor(expected), atol=1e-6, rtol=0)
    # through the engine: top_k=1 is the most likely token with certainty (log-prob 0)
    model, tokenizer = tiny
    rows = _rows(tokenizer)[:3]
    done = _serve(_core(model, tokenizer, 4), rows, temperature=0.7, top_k=1)
    greedy = _serve(_core(model, tokenizer, 4), rows, greedy=True)
    assert [d.token_ids for d in done] == [g.token_ids for g in greedy]
    assert all(lp == 0.0 for d in done for lp in d.logprobs)


class _UpdateAfter:
    """A stepper that queues a weight update on its core after ``steps`` steps: the update
    lands between two decoding steps, with requests in flight."""

    def __init__(self, inner, steps: int, update) -> None:
        self.inner, self.steps, self.update = inner, steps, update
        self.core: EngineCore | None = None
        self.taken = 0

    def step(self, admitted, running, version) -> None:
        self.inner.step(admitted, running, version)
        self.taken += 1
        if self.taken == self.steps:
            assert self.core is not None
            self.update_future = self.core.call(self.update)

    def release(self, ended) -> None:
        self.inner.release(ended)


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_a_request_spanning_a_weight_update_keeps_exact_per_token_versions(tiny, kv):
    """The update is written in after step 3 and nothing is aborted: every request's first
    three tokens carry version 0 and the old weights' log-probs, the rest version 5; with
    ``recompute`` the later ones are exactly the new weights' log-probs."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    before = copy.deepcopy(model)
    batch = HFBatch(model, eos_id=None, pad_id=tokenizer.pad_token_id)  # no early ends

    def update() -> int:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        if kv == "recompute":
            batch.forget()
        return 5

    stepper = _UpdateAfter(batch, 3, update)
    core = EngineCore(stepper, max_num_seqs=8)
    stepper.core = core
    rows = _rows(tokenizer)[:4]
    done = _serve(core, rows, new=8)
    assert stepper.update_future.result(1) == 5 and core.version == 5
    for d in done:
        assert d.versions == [0, 0, 0, 5, 5, 5, 5, 5] and d.finish_reason == "length"
    out, old = _recomputed(before, tokenizer, rows, done, 0.9)
    _, new = _recomputed(model, tokenizer, rows, done, 0.9)
    torch.testing.assert_close(out.logprobs[:, :3], old[:, :3], atol=1e-5, rtol=0)
    after = (out.logprobs[:, 3:] - new[:, 3:]).abs().max()
    assert (out.logprobs[:, 3:] - old[:, 3:]).abs().max() > 1e-3  # the weights did change
    if kv == "recompute":
        assert after < 1e-5
    else:  # the old weights' keys and values: neither policy's log-probs exactly
        assert after > 1e-6
    assert (out.version_spans() == 5).all()


def test_a_failed_step_fails_its_requests_and_the_core_serves_the_next(tiny):
    model, tokenizer = tiny

    class Broken:
        def __init__(self) -> None:
            self.inner = HFBatch(model, eos_id=None, pad_id=tokenizer.pad_token_id)
            self.fail = True

        def step(self, admitted, running, version):
            if self.fail:
                self.fail = False
                raise RuntimeError("out of memory")
            self.inner.step(admitted, running, version)

        def release(self, ended):
            self.inner.release(ended)

    core = EngineCore(Broken(), max_num_seqs=4)
    first = core.submit(Request((5, 6), 3, 1.0, seed=0))
    with pytest.raises(RuntimeError, match="out of memory"):
        first.result(30)
    assert len(core.submit(Request((5, 6), 3, 1.0, seed=0)).result(30).token_ids) == 3
    core.close()
    with pytest.raises(RuntimeError, match="closed; no request is taken"):
        core.submit(Request((5,), 1, 1.0, seed=0))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_ids": ()}, "Request.prompt_ids: empty"),
        ({"max_new_tokens": 0}, "Request.max_new_tokens: 0; use an int >= 1"),
        ({"temperature": 0.0}, "Request.temperature: 0.0; use a float > 0"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(fields, message):
    values = {"prompt_ids": (1,), "max_new_tokens": 2, "temperature": 1.0, "seed": 0, **fields}
    with pytest.raises(ValueError, match=message):
        Request(**values)


def test_a_request_not_answered_in_time_is_named():
    never: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(TimeoutError, match=r"worker 3: a request was not answered within 0.1 s"):
        wait_all([never], 0.1, "worker 3")


def test_the_lockstep_core_continues_requests_chunk_by_chunk_across_an_update(tiny):
    """An engine that only has ``extend``: each call advances every live request by two
    tokens, and an update between two calls reaches the requests in flight."""
    from rlwire.trainer.rollout import hf_extend

    model, tokenizer = tiny
    model = copy.deepcopy(model)

    class Extending:
        def __init__(self) -> None:
            self.tokenizer = tokenizer

        def extend(self, batch, max_new_tokens, seed):
            return hf_extend(
                model, tokenizer, batch, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed
            )

    def update() -> int:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        return 1

    stepper = _UpdateAfter(LockstepStepper(Extending(), chunk_tokens=2), 1, update)
    core = EngineCore(stepper, max_num_seqs=8)
    stepper.core = core
    rows = _rows(tokenizer)
    done = _serve(core, rows, new=6, temperature=1.0)
    for d in done:
        assert d.versions == ([0, 0, 1, 1, 1, 1][: len(d.token_ids)])
        assert d.finish_reason == "stop" or len(d.token_ids) == 6
    assert stepper.update_future.result(1) == 1


def _model_call(
    model,
    log: list,
    gate: threading.Lock,
    active: list,
    slow: tuple[threading.Event, threading.Event] | None = None,
):
    """A server's completion call (:data:`~rlwire.trainer.rollout.chains.Complete`) sampled
    from ``model`` (no end-of-sequence token: every call returns what it was asked); it
    counts the calls in flight in ``active[0]`` and logs each one's ``request_id`` as it ends.
    ``slow``: (``started``, ``release``): request ``slow``'s first call sets ``started`` and
    answers only once ``release`` is set."""

    def complete(context, max_tokens, seed, request):
        with gate:
            active[0] += 1
        try:
            if slow is not None and request.request_id == "slow" and "slow" not in log:
                started, release = slow
                started.set()
                assert release.wait(60), "the slow call was never released"
            gen = torch.Generator().manual_seed(seed)
            ids, tokens, logprobs = list(context), [], []
            with torch.no_grad():
                for _ in range(max_tokens):
                    logits = model(torch.tensor([ids])).logits[0, -1].float()
                    logp = torch.log_softmax(logits / request.temperature, -1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    tokens.append(token)
                    logprobs.append(float(logp[token]))
                    ids.append(token)
            log.append(request.request_id)
            return tokens, logprobs, "length"
        finally:
            with gate:
                active[0] -= 1

    return complete


def test_server_chains_hold_a_commit_until_no_call_is_in_flight_and_stamp_exact_versions(tiny):
    """``vllm_server``'s requests (:mod:`.chains`): chains of calls of 2 tokens, all in
    flight at once; an update queued after the first answer is written in only once no call
    is in flight (no new call starts meanwhile), and every call's tokens carry the version
    it ran on: each request's first call version 0, its last version 1."""
    from rlwire.trainer.rollout.chains import ChainStepper

    model, tokenizer = tiny
    model = copy.deepcopy(model)
    log: list = []
    gate, active, seen = threading.Lock(), [0], []

    def update() -> int:
        seen.append(active[0])  # calls in flight while the weights change: must be none
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.05)
        return 1

    class UpdateAfterFirst(ChainStepper):
        def step(self, admitted, running, version):
            super().step(admitted, running, version)
            if not hasattr(self, "update_future"):
                self.update_future = self.core.call(update)

    complete = _model_call(model, log, gate, active)
    stepper = UpdateAfterFirst(
        complete, eos=None, chunk_tokens=2, max_in_flight=8, timeout=30, name="t"
    )
    core = EngineCore(stepper, max_num_seqs=8)
    stepper.core = core
    rows = _rows(tokenizer)[:4]
    done = _serve(core, rows, new=6, temperature=1.0)
    assert stepper.update_future.result(1) == 1 and seen == [0]
    for d in done:
        assert len(d.token_ids) == 6 and d.finish_reason == "length"
        assert d.versions[:2] == [0, 0] and d.versions[4:] == [1, 1]
        assert d.versions[2] == d.versions[3]  # one call, one version
    assert any(d.versions[2] == 1 for d in done)  # the calls held back started after it
    core.close()


def test_a_slow_server_call_holds_back_no_other_request(tiny):
    """One request's first call does not answer until the others ended: they end all the
    same, while it is in flight."""
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.rollout.chains import chain_core

    model, tokenizer = tiny
    log: list = []
    started, release = threading.Event(), threading.Event()
    complete = _model_call(model, log, threading.Lock(), [0], slow=(started, release))
    config = load_config(
        overrides=["async.partial_rollout=true", "async.partial_rollout_chunk_tokens=2"]
    )
    core = chain_core(complete, eos=None, config=config, index=0, name="t")
    rows = _rows(tokenizer)[:4]
    requests = [
        Request(tuple(r), 4, 1.0, seed=i, request_id="slow" if i == 0 else f"r{i}")
        for i, r in enumerate(rows)
    ]
    futures = core.submit_all(requests)
    try:
        assert started.wait(30), "the slow request's first call never started"
        wait_all(futures[1:], 30, "the requests beside the held call")
        assert not futures[0].done()  # the others ended while the slow one's first call ran
    finally:
        release.set()
    assert len(futures[0].result(30).token_ids) == 4
    assert log.index("slow") > max(log.index(f"r{i}") for i in (1, 2, 3))
    core.close()


def test_a_lost_engine_fails_its_requests_at_once_and_refuses_more():
    """A server that stopped answering (its calls hang): :meth:`EngineCore.fail` ends every
    request in flight and waiting, and the weight commit queued behind them, with the
    engine's :class:`EngineLost` at once, not after the calls' timeout; a later submit gets
    the same error, and the hung calls' answers, when they come, are dropped."""
    from rlwire.trainer.rollout import EngineLost
    from rlwire.trainer.rollout.chains import ChainStepper

    release, started = threading.Event(), threading.Semaphore(0)

    def hung(context, max_tokens, seed, request):
        started.release()
        release.wait(30)  # a stopped server: no answer until it goes on
        return [7] * max_tokens, [-0.5] * max_tokens, "length"

    stepper = ChainStepper(hung, eos=None, chunk_tokens=None, max_in_flight=2, timeout=60, name="t")
    core = EngineCore(stepper, max_num_seqs=2)
    stepper.core = core
    futures = core.submit_all([Request((1, 2), 3, 1.0, seed=i) for i in range(3)])
    for _ in range(2):  # two calls in flight, the third request waits for room
        assert started.acquire(timeout=30)
    commit = core.call(lambda: 1)
    lost = EngineLost("vllm_server http://x: no answer to /health for 6 s", 0)
    core.fail(lost)
    # at once: all resolved when fail returns, while the calls still hang (not released)
    assert all(future.done() for future in [*futures, commit])
    for future in [*futures, commit]:
        with pytest.raises(EngineLost) as err:
            future.result(timeout=0)
        assert err.value is lost
    with pytest.raises(EngineLost):
        core.submit(Request((1,), 1, 1.0, seed=9))
    release.set()  # the hung calls answer now: nothing raises in the core's thread
    core.close(timeout=10)
    assert not core._thread.is_alive()


# --- conversations that never wait for each other ------------------------------------------


def test_a_tool_wait_holds_back_no_other_conversation():
    """Conversation x's environment waits (in its thread) until conversation y has run two
    model turns and its second environment step. In a loop where every conversation's tool
    calls run behind one barrier, y's second turn never starts while x waits, and x's step
    ran out its time; here y goes on and x's step answers."""
    from agent_tools import Rendezvous
    from test_trainer_agent import ScriptedEngine, _tokenizer

    from rlwire.trainer.agent.config import AgentConfig
    from rlwire.trainer.agent.loop import AgentLoop
    from rlwire.trainer.agent.render import ChatRenderer
    from rlwire.trainer.rollout import Example

    tok = _tokenizer()
    ids, eos = tok.convert_tokens_to_ids, tok.eos_token_id
    examples = [
        Example(prompt=p, answer="", messages=[{"role": "user", "content": p}]) for p in "xy"
    ]
    renderer = ChatRenderer(tok)
    prompts = [renderer.prompt(e) for e in examples]
    turn = [ids("a"), eos]
    engine = ScriptedEngine({tuple(p): [turn, turn, turn] for p in prompts}, eos)
    config = AgentConfig(enable=True, tool_timeout=10.0)
    Rendezvous.reset_all()
    loop = AgentLoop(engine, tok, renderer, Rendezvous, config, 64)
    out = loop.run(examples, 1, seed=0)
    waiting, going = out.trajectories
    assert waiting.error is None and waiting.stop == "done"
    assert going.error is None and going.stop == "done"
    assert waiting.rewards == [1.0] and going.rewards == [0.0, 1.0]


def _alive(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_a_sync_tool_past_its_time_is_stopped_not_left_running():
    from test_trainer_agent import _runner

    from rlwire.trainer.agent import ParsedCall

    runner = _runner("spin", timeout=0.2)
    (result,) = runner.run([ParsedCall("spin", {"seconds": 600.0})])
    assert result.error == "'spin' did not answer within 0.2 s"
    deadline = time.monotonic() + 10
    while _alive("tool-spin") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive("tool-spin")  # before the fix: spinning for 600 s


def test_an_async_tool_that_blocks_holds_back_no_other_async_tool():
    """``hold`` blocks its thread (``threading.Event.wait``, not an ``await``) until
    ``release`` runs: on one shared event loop ``release`` never runs and ``hold`` gives
    up; each in a loop of its own, both answer."""
    from test_trainer_agent import _runner

    from rlwire.trainer.agent import ParsedCall

    runner = _runner("hold", "release", timeout=10.0)
    results = runner.run([ParsedCall("hold", {"seconds": 5.0}), ParsedCall("release", {})])
    assert [r.text for r in results] == ["released", "done"]


def test_an_engine_without_requests_or_extend_is_refused_naming_it():
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.rollout.base import RolloutEngine

    class Batched(RolloutEngine):  # a third party's engine: generate() only
        def generate(self, prompts, seed, sampling=None):
            raise AssertionError("not called")

        async def apply(self, engine):
            return 0

        def digest(self):
            return None

    engine = Batched(load_config(), "", torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="rollout engine Batched: takes no requests"):
        engine.submit(Request((1,), 1, 1.0, seed=0))
