"""The ``vllm`` rollout backend against a live ``vllm.LLM`` engine (marked ``vllm``: run in an
environment with vLLM, e.g. by ``.ci/vllm``; deselected by default).

Every test here runs on conftest's shared Ray cluster: the jobs join it from pytest's
process (``train_cli(..., cluster=...)``), the tests that drive a rollout worker themselves
connect for the test (``ray_driver``) and disconnect, killing what they started."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest
import torch
from trainer_cli import run_cli, train_cli

pytestmark = pytest.mark.vllm

# vLLM's log-probs of a tiny fp32 model against a Hugging Face forward pass; measured
# differences are below 1e-6 (ENVIRONMENT.md: 8e-6). A weight update of x1.1 moves them
# by far more than this.
TOLERANCE = 1e-4


@pytest.fixture
def ray_driver(ray_cluster):
    """Ray, connected to the shared cluster for this test (its actors die as it disconnects)."""
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    from rlwire.trainer.runtime.cluster import ray_environment

    ray_environment()
    import ray

    ray.init(address=ray_cluster, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_vllm_logprobs_match_the_actor_before_and_after_a_weight_sync(ray_driver, tmp_path):
    """Updates reach vLLM's worker through its weight-transfer engine (``rlwire``), deltas
    included, and vLLM samples from the weights sent. The model's generation_config.json
    penalises repetition and cuts to the top 5: vLLM's (processed) log-probs are still the
    actor's plain softmax(logits / T) ones."""
    from transformers import AutoModelForCausalLM

    from rlwire.ckpt_engine import registry
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.models.tiny import build_tiny_model, repeat_prompts
    from rlwire.trainer.rollout import Example, sequence_logprobs
    from rlwire.trainer.runtime.rollout_worker import RolloutWorker

    ray = ray_driver
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    file = model_dir / "generation_config.json"
    penalties = {"do_sample": True, "repetition_penalty": 1.5, "top_k": 5, "min_p": 0.2}
    file.write_text(json.dumps({**json.loads(file.read_text()), **penalties}))
    temperature = 0.7
    config = load_config(
        overrides=[
            "rollout.backend=vllm",
            "rollout.n=4",
            "rollout.max_new_tokens=12",
            f"rollout.temperature={temperature}",
            "async.partial_rollout=true",
            "async.partial_rollout_chunk_tokens=3",
        ]
    )
    worker = ray.remote(num_cpus=1)(RolloutWorker).remote(config, str(model_dir), 0)
    ray.get(worker.load_engine.remote(), timeout=300)
    sender = registry.new("gloo", is_master=True, bucket_size="1MiB", timeout=120, delta="on")
    metadata = sender.prepare()
    joined = worker.engine_init.remote("gloo", 2, metadata)
    sender.init_process_group(rank=0, world_size=2, master_metadata=metadata)
    ray.get(joined, timeout=300)
    examples = [Example(prompt=p, answer=a) for p, a in repeat_prompts(6, seed=1)]

    def max_error(model, out) -> float:
        reference = sequence_logprobs(
            model,
            out.prompt_ids,
            out.prompt_mask,
            out.response_ids,
            temperature=temperature,
        )
        mask = out.response_mask.bool()
        return float((reference - out.logprobs)[mask].abs().max())

    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert actor.generation_config.repetition_penalty == 1.5  # the file is there
    before = ray.get(worker.generate.remote(examples, 123), timeout=300)
    assert before.response_ids.shape[0] == len(examples) * 4
    assert before.response_mask.sum() > 0
    with torch.no_grad():
        assert max_error(actor, before) < TOLERANCE
        # same seed, same weights: the same samples
        again = ray.get(worker.generate.remote(examples, 123), timeout=300)
        assert torch.equal(again.response_ids, before.response_ids)
        # as requests through the lock-step core, in calls of 3 tokens (each continuing the
        # requests from their token ids): the same log-probs
        chunked = ray.get(worker.generate_requests.remote(examples, 5), timeout=300)
        assert len(chunked) == len(before) and chunked.response_mask[:, 3:].any()
        assert max_error(actor, chunked) < TOLERANCE
        assert (chunked.versions[chunked.response_mask.bool()] == 0).all()  # the first weights

        # a weight update through the checkpoint engine into the live engine
        updated = {name: value * 1.1 for name, value in actor.state_dict().items()}
        pulled = worker.pull_weights.remote()
        stats = asyncio.run(sender.send_weights(updated.items(), version=1))
        assert stats.tensors == len(updated)
        assert ray.get(pulled, timeout=300)["version"] == 1
        after = ray.get(worker.generate.remote(examples, 123), timeout=300)
        actor.load_state_dict(updated)
        assert max_error(actor, after) < TOLERANCE  # the engine now holds the new weights
        original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        assert max_error(original, after) > 100 * TOLERANCE  # and not the old ones

        # a sparse change crosses as a delta straight into vLLM's worker (its weight-transfer
        # engine holds version 1), and vLLM generates from the result
        nudged = {name: value.clone() for name, value in updated.items()}
        head = next(name for name in nudged if name.endswith("lm_head.weight"))
        nudged[head][:, :3] += 0.5
        pulled = worker.pull_weights.remote()
        stats = asyncio.run(sender.send_weights(nudged.items(), version=2))
        assert stats.base == 1 and stats.wire_bytes < stats.bytes / 10
        assert ray.get(pulled, timeout=300)["version"] == 2
        nudged_out = ray.get(worker.generate.remote(examples, 123), timeout=300)
        actor.load_state_dict(nudged)
        assert max_error(actor, nudged_out) < TOLERANCE
    sender.finalize()


def _vllm_requests_scenario(model_dir: str, metadata: dict, prompts: list[list[int]]) -> dict:
    """Run in a Ray task of its own (vLLM changes its host process): a ``vllm`` engine
    serving requests. ``joined``: six requests through a batch of three (each joining as
    another ends), and ``alone``: each by itself. ``keep`` / ``recompute``: four requests of
    eight tokens with an update (received from the test's sender: versions 5, then 6)
    written in after the engine's third step."""
    import asyncio

    import torch

    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.rollout.requests import Request, wait_all
    from rlwire.trainer.rollout.vllm import VLLMEngine

    config = load_config(overrides=["rollout.backend=vllm", "rollout.max_num_seqs=3"])
    engine = VLLMEngine(config, model_dir, torch.device("cpu"))
    handle = engine.join("gloo", rank=1, world_size=2, metadata=metadata)

    def serve(rows, new, seed):
        futures = engine.submit_all(
            [Request(tuple(r), new, 0.9, seed=seed + i) for i, r in enumerate(rows)]
        )
        return [(d.token_ids, d.logprobs, d.versions) for d in wait_all(futures, 120, "test")]

    out: dict = {"joined": serve(prompts, 6, 100)}
    out["alone"] = [serve([p], 6, 100 + i)[0] for i, p in enumerate(prompts)]
    engine.core.max_num_seqs = 8
    for kv in ("keep", "recompute"):
        config.rollout.kv_on_update = kv
        commit = asyncio.run(engine.stage(handle))  # received beside the weights in use
        inner, seen = engine.stepper.step, {"steps": 0}

        def step(admitted, running, version, inner=inner, commit=commit, seen=seen):
            inner(admitted, running, version)
            seen["steps"] += 1
            if seen["steps"] == 3:  # queued now: written in before the fourth step
                seen["commit"] = engine.core.call(commit)

        engine.stepper.step = step
        out[kv] = serve(prompts[:4], 8, 200)
        out[kv + "_version"] = seen["commit"].result(30)
        engine.stepper.step = inner
    return out


def test_vllm_serves_requests_on_its_own_continuous_batching(ray_driver, tmp_path):
    """``vllm``'s requests (one ``LLMEngine.step`` per core step): requests joining a running
    batch get the tokens they get alone and the actor's log-probs; an update written in
    after the third step aborts nothing: each request's tokens carry the old version three
    times, then the new one, its first three with the old weights' log-probs; with
    ``recompute`` the later ones are exactly the new weights' log-probs, with ``keep`` (the
    old weights' KV cache) they are not."""
    from ray import cloudpickle
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlwire.ckpt_engine import registry
    from rlwire.trainer.models.tiny import build_tiny_model
    from rlwire.trainer.rollout import sequence_logprobs
    from rlwire.trainer.rollout.tokens import token_rollout

    ray = ray_driver
    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = ["a:", "bcd:", "e:", "fghij:", "k:", "lm:"]
    prompts = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in words]
    sender = registry.new("gloo", is_master=True, bucket_size="1MiB", timeout=120)
    metadata = sender.prepare()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the task's code, by value
    try:
        scenario = ray.remote(num_cpus=1)(_vllm_requests_scenario)
        task = scenario.remote(str(model_dir), metadata, prompts)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    sender.init_process_group(rank=0, world_size=2, master_metadata=metadata)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    models = {0: base}
    for version in (5, 6):
        weights = {k: v * (1 + 0.05 * (version - 4)) for k, v in base.state_dict().items()}
        asyncio.run(sender.send_weights(weights.items(), version=version))
        models[version] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        models[version].load_state_dict(weights)
        models[version].eval()
    out = ray.get(task, timeout=600)
    sender.finalize()

    def logprobs(model, rows, served):
        rows = [(p, t, lp) for p, (t, lp, _) in zip(rows, served, strict=True)]
        batch = token_rollout(tokenizer, rows)
        with torch.no_grad():
            ref = sequence_logprobs(
                model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, temperature=0.9
            )
        return batch, ref

    assert [t for t, _, _ in out["joined"]] == [t for t, _, _ in out["alone"]]
    batch, ref = logprobs(base, prompts, out["joined"])
    assert float((ref - batch.logprobs)[batch.response_mask.bool()].abs().max()) < TOLERANCE
    for kv, old, new in (("keep", 0, 5), ("recompute", 5, 6)):
        assert out[kv + "_version"] == new
        for tokens, _, versions in out[kv]:
            assert versions == [old] * 3 + [new] * (len(tokens) - 3), (kv, versions)
            assert len(tokens) == 8 or tokens[-1] == tokenizer.eos_token_id
        batch, before = logprobs(models[old], prompts[:4], out[kv])
        _, after = logprobs(models[new], prompts[:4], out[kv])
        mask = batch.response_mask.bool()
        first, rest = mask.clone(), mask.clone()
        first[:, 3:], rest[:, :3] = False, False
        assert float((before - batch.logprobs)[first].abs().max()) < TOLERANCE
        gap = float((after - batch.logprobs)[rest].abs().max())
        assert gap < TOLERANCE if kv == "recompute" else gap > 10 * TOLERANCE, (kv, gap)


def _endpoint_on_vllm_scenario(model_dir: str) -> dict:
    """Run in a Ray task of its own: the agent endpoint on a ``vllm`` engine, and an agent's
    two chat calls to it with the ``openai`` client (the second after the first's reply and
    a tool message)."""
    import asyncio

    import openai
    import torch

    from rlwire.trainer.agent.endpoint import Endpoint
    from rlwire.trainer.agent.parsers import HermesParser
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.rollout.vllm import VLLMEngine

    config = load_config(overrides=["rollout.backend=vllm", "rollout.max_new_tokens=24"])
    engine = VLLMEngine(config, model_dir, torch.device("cpu"))
    endpoint = Endpoint(
        engine.submit, engine.tokenizer, HermesParser(), temperature=1.0, max_new_tokens=24,
        timeout=120,
    )  # fmt: skip
    url = endpoint.start()
    session = endpoint.sessions.open(seed=11)
    messages = [{"role": "user", "content": "abc"}]

    async def talk():
        async with openai.AsyncOpenAI(base_url=url, api_key=session.key) as client:
            first = await client.chat.completions.create(model="m", messages=messages)
            history = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
            history.append({"role": "tool", "content": "123"})
            second = await client.chat.completions.create(model="m", messages=history)
        return first.model_dump(), second.model_dump()

    first, second = asyncio.run(talk())
    calls = endpoint.sessions.close(session)
    endpoint.stop()
    return {"first": first, "second": second, "calls": [c.prompt_ids for c in calls]}


def test_the_agent_endpoint_on_vllm_answers_token_for_token(ray_driver):
    """An agent's two chat calls through the endpoint on the ``vllm`` engine: the second's
    prompt is the first's prompt and sampled ids, exactly, then the tool turn; the answers'
    log-probs are the model's (within 1e-4)."""
    from cached_models import cached_lookup_model
    from ray import cloudpickle
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlwire.trainer.agent.render import ChatRenderer

    model_dir = cached_lookup_model(seed=0)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        task = ray_driver.remote(num_cpus=1)(_endpoint_on_vllm_scenario).remote(str(model_dir))
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    out = ray_driver.get(task, timeout=600)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first, second = out["first"], out["second"]
    sampled = first["choices"][0]["token_ids"]
    turn = ChatRenderer(tokenizer).turn([{"role": "tool", "content": "123"}])
    assert sampled[-1] == tokenizer.eos_token_id  # the primed model ends its turn
    assert second["prompt_token_ids"] == first["prompt_token_ids"] + sampled + turn
    assert out["calls"] == [tuple(first["prompt_token_ids"]), tuple(second["prompt_token_ids"])]
    for answer in (first, second):
        prompt, tokens = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        got = torch.tensor([c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]])
        assert float((expected - got).abs().max()) < TOLERANCE
        assert answer["weight_versions"] == [0] * len(tokens)


@pytest.mark.parametrize("mode", ["fully_async", "colocated"])
def test_short_run_with_the_vllm_backend(ray_cluster, mode, tmp_path):
    # fully async with partial rollouts: responses go in chunks of 3 tokens through extend
    partial = ["async.partial_rollout=true", "async.partial_rollout_chunk_tokens=3"]
    records, _ = train_cli(
        tmp_path / "run",
        f"trainer.mode={mode}",
        "rollout.backend=vllm",
        "trainer.steps=3",
        *(partial if mode == "fully_async" else []),
        cluster=ray_cluster,
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["grad_norm"] == r["grad_norm"]
        if r["version_lag_max"] == 0:  # generated with the weights being updated:
            assert abs(r["kl_rollout"]) < 1e-3  # vLLM's log-probs = the actor's recomputation


def test_a_lora_run_serves_each_synced_adapter_from_vllm(ray_cluster, tmp_path):
    """Colocated LoRA with the vllm backend: each sync carries the adapter alone (bytes:
    the exported adapter's), vLLM serves it as its LoRA, and its log-probs stay the actor's
    as the adapter moves (a stale or missing adapter would show in ``kl_rollout``)."""
    from safetensors import safe_open

    run = tmp_path / "run"
    records, _ = train_cli(
        run,
        "rollout.backend=vllm",
        "actor.lora.rank=8",
        "actor.optim.lr=3e-2",
        "trainer.steps=4",
        cluster=ray_cluster,
    )
    with safe_open(str(run / "adapter" / "adapter_model.safetensors"), "pt") as f:
        adapter = sum(f.get_tensor(k).numel() * 4 for k in f.keys())  # noqa: SIM118
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["weight_sync_bytes"] == adapter, r
        assert abs(r["kl_rollout"]) < 1e-3, r


def test_the_agent_loop_on_vllm_is_token_in_token_out(ray_driver, tmp_path):
    """The lookup task's conversations on vLLM (requests through its lock-step core), in a
    rollout worker whose engine records each request: every model turn is a request of
    exactly the sequence so far (the previous turns, the tokens the engine returned, then
    the template's tool turn), the trajectory is the last context plus what the engine
    returned, the loss mask is 1 on exactly those tokens, and their behaviour log-probs are
    the actor's."""
    import collections

    from cached_models import cached_lookup_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.data.tasks import BUILTIN_TASKS
    from rlwire.trainer.rollout import sequence_logprobs
    from rlwire.trainer.runtime.rollout_worker import RolloutWorker

    class RecordingWorker(RolloutWorker):
        """Records every request its agent loop makes: its context (prompt token ids) and
        the tokens and log-probs the engine returned. Defined here: Ray sends it to the
        worker by value."""

        def load_engine(self) -> None:
            RolloutWorker.load_engine(self)
            engine, self.requests = self.agent.engine, []

            def submit(request):
                future = engine.submit(request)
                context = list(request.prompt_ids)

                def record(done) -> None:
                    got = done.result()
                    self.requests.append((context, got.token_ids, got.logprobs))

                future.add_done_callback(record)
                return future

            self.agent.engine = types.SimpleNamespace(submit=submit)

        def recorded(self) -> list:
            return self.requests

    ray = ray_driver
    model_dir = cached_lookup_model(seed=0)
    temperature, budget = 1.2, 24
    config = load_config(
        overrides=[
            "data.source=builtin:lookup",
            "rollout.backend=vllm",
            "rollout.n=4",
            f"rollout.max_new_tokens={budget}",
            f"rollout.temperature={temperature}",
        ]
    )
    # the primed model calls the tool in ~7% of first turns: some of these 128
    # conversations do (none would be a 1e-4 chance)
    examples = BUILTIN_TASKS["lookup"].examples(32, 3, "builtin:lookup")
    worker = ray.remote(num_cpus=1)(RecordingWorker).remote(config, str(model_dir), 0)
    try:
        ray.get(worker.load_engine.remote(), timeout=300)
        out = ray.get(worker.generate.remote(examples, 11), timeout=300)
        requests = ray.get(worker.recorded.remote(), timeout=60)
    finally:
        ray.kill(worker)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = out.trajectories
    assert len(out) == len(records) == 4 * len(examples)
    turns = [r.assistant_turns for r in records]
    assert len(requests) == sum(turns) and max(turns) >= 2  # a request per model turn
    by_context = collections.defaultdict(list)
    for context, tokens, logprobs in requests:
        by_context[tuple(context)].append((tokens, logprobs))
    for j, record in enumerate(records):
        prompt = out.prompt_ids[j][out.prompt_mask[j].bool()].tolist()
        length = record.turns[-1].end
        response = out.response_ids[j][:length].tolist()
        mask = [0] * out.response_mask.shape[1]
        logprobs = []
        sequence = list(prompt)  # what the next model turn must be given
        model_turns = [t for t in record.turns if t.role == "assistant"]
        for k, turn in enumerate(model_turns):
            returned = response[turn.start : turn.end]
            assert turn.start == len(sequence) - len(prompt), (j, k)
            # token in and out: a request of exactly the sequence so far returned these tokens
            asked = by_context[tuple(sequence)]
            match = next((m for m in asked if m[0] == returned), None)
            assert match is not None, (j, k)
            asked.remove(match)
            mask[turn.start : turn.end] = [1] * len(returned)
            logprobs += match[1]
            sequence += returned
            if k + 1 < len(model_turns):  # the tool's answer, as the lookup template writes it
                tool = f"<|tool|><tool_response>{record.tool_results[k].text}</tool_response>"
                tool += "<eos><|assistant|>"
                sequence += tokenizer(tool, add_special_tokens=False)["input_ids"]
        # (a) token out: the trajectory is the last context plus what the engine returned
        assert prompt + response == sequence, j
        # (b) the loss mask: 1 on the engine's tokens, 0 on the tool's and template's
        assert out.response_mask[j].tolist() == mask, j
        chosen = out.response_mask[j].bool()
        torch.testing.assert_close(out.logprobs[j][chosen], torch.tensor(logprobs), atol=0, rtol=0)
    # (c) the behaviour log-probs of the model's tokens are the actor's own, and the
    # environment's tokens carry none; every token of the first weights (version 0)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = sequence_logprobs(
            actor, out.prompt_ids, out.prompt_mask, out.response_ids, temperature=temperature
        )
    model = out.response_mask.bool()
    assert float((reference - out.logprobs)[model].abs().max()) < TOLERANCE
    assert (out.logprobs[~model] == 0).all() and (out.versions[model] == 0).all()
    # (d) conversations called the tool and went on after its answer
    called = [j for j, r in enumerate(records) if r.tool_results]
    assert called and any(turns[j] >= 2 for j in called)
    assert any(r.error is None for j in called for r in records[j].tool_results)


# --- rollout.backend=vllm_server: vllm serve servers over HTTP ------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A ``vllm serve`` server for a tiny model, started as a user would (the README's flags),
    shared by the tests that give its URL: ``(model_dir, url)``."""
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    from vllm_serve import vllm_serve

    with vllm_serve(tmp_path_factory.mktemp("served")) as (model_dir, url, _):
        yield model_dir, url


def _weight_version(url: str) -> str | None:
    from vllm_serve import weight_version

    return weight_version(url)


def test_a_run_on_a_running_vllm_server_then_a_second_run_is_refused(served, ray_cluster, tmp_path):
    """Colocated on a server given by URL: token ids in and out, the server's log-probs are
    the actor's, every sync lands (the server's weight version is the last one sent); a
    second run on the same server, which now holds that run's weights, is refused."""
    model_dir, url = served
    common = [
        f"model.path={model_dir}",
        "rollout.backend=vllm_server",
        f"rollout.server_urls=[{url}]",
    ]
    records, _ = train_cli(tmp_path / "run", *common, "trainer.steps=3", cluster=ray_cluster)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["version_lag_max"] == 0 and abs(r["kl_rollout"]) < 1e-3, r
        assert r["weight_sync_bytes"] > 0
    assert _weight_version(url) == "3"
    code, out = run_cli(tmp_path / "again", *common, cluster=ray_cluster)
    assert code != 0
    assert f"vllm_server {url} serves weights version 3 that an earlier run sent" in out


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A ``vllm serve`` server started as a run starts it (``ServerProcess.start``: loopback,
    ``rlwire_shm``, a fresh token in its environment, rlwire's guard): ``(process, model_dir)``."""
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.models.tiny import build_tiny_model
    from rlwire.trainer.rollout.vllm_http import VLLMServer
    from rlwire.trainer.rollout.vllm_process import ServerProcess

    model_dir = build_tiny_model(tmp_path_factory.mktemp("started") / "tiny", seed=0)
    config = load_config(overrides=["rollout.backend=vllm_server", f"model.path={model_dir}"])
    process = ServerProcess.start(config, str(model_dir), backend="shm")
    try:
        process.wait_ready(VLLMServer(process.url, timeout=30), 300)
        yield process, model_dir
    finally:
        process.stop()
    assert _rpc_dirs(process) == [], "the server's socket directory outlived it"


def _rpc_dirs(process) -> list:
    """The directories of vLLM's sockets that the watchdog of ``process`` made."""
    import tempfile
    from pathlib import Path

    from rlwire.trainer.rollout.vllm import RPC_PREFIX

    pattern = f"{RPC_PREFIX}{process.process.pid}-*"
    return sorted(Path(tempfile.gettempdir()).glob(pattern))


def test_a_started_servers_sockets_are_in_its_own_directory_not_the_temp_dir(started):
    """vLLM's ZMQ IPC sockets of a server the run started are in the watchdog's private
    directory (0o700; removed when it stops: the fixture checks), none of them in the temp
    dir (each engine used to leave its own there)."""
    import stat
    import tempfile
    from pathlib import Path

    process, _ = started
    (rpc,) = _rpc_dirs(process)
    assert stat.S_IMODE(rpc.stat().st_mode) == 0o700
    sockets = [p for p in rpc.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
    assert sockets, "vLLM made no socket in VLLM_RPC_BASE_PATH: does it still read it?"
    names = {p.name for p in sockets}
    loose = [p for p in Path(tempfile.gettempdir()).iterdir() if p.name in names]
    assert loose == []


def _post(url: str, body: dict, token: str | None = None) -> tuple[int, str]:
    """POST ``body`` as JSON: the status and the answer's text (an error's too)."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_stranger_on_the_host_cannot_write_weights_into_a_server_the_run_started(started):
    """The review's attack: a stranger reads the port from the command line and posts an init
    naming a store of their own (host, port, secret): refused at the door without the token
    (every weight and RPC route: ``reload_weights`` from a path of theirs too), refused by
    the engine past the door without the token or with options of theirs, and the server
    keeps the model's own weights; the run's own token joins, and its update lands."""
    import threading

    from safetensors.torch import load_file

    from rlwire.ckpt_engine import registry
    from rlwire.trainer.rollout.vllm_http import VLLMServer

    process, model_dir = started
    url, token = process.url, process.token
    assert token not in " ".join(process.process.args)  # not on the command line
    theirs = registry.new("shm", is_master=True, bucket_size="1MiB", timeout=20)
    info = {
        "backend": "rlwire_shm",
        "master_metadata": theirs.prepare(),  # their store: host, port, secret
        "world_size": 2,
        "rank_offset": 1,
        "timeout": 20,
    }
    try:
        attempts = [
            ("/init_weight_transfer_engine", {"init_info": info}),
            ("/init_weight_transfer_engine", {"init_info": {**info, "token": "0" * 64}}),
            ("/collective_rpc", {"method": "reload_weights",
                                 "kwargs": {"weights_path": str(model_dir)}}),
            ("/update_weights", {"update_info": {}}),
        ]  # fmt: skip
        for path, body in attempts:
            for guess in (None, "0" * 64):
                status, text = _post(url + path, body, guess)
                assert status == 401, (path, status, text)
                assert "requires its weight-transfer token (RLWIRE_WEIGHT_TRANSFER_TOKEN)" in text
        # past the door (a caller with the token at the HTTP level), the engine still wants
        # it in the init info, and takes no options from the caller
        for extra, refusal in [
            ({}, "refused: this server takes weights only from the run that started it and "
                 "the init info carries no token"),
            ({"token": "0" * 64}, "the init info's token is not its RLWIRE_WEIGHT_TRANSFER_TOKEN"),
            ({"token": token, "options": {"root": "/tmp"}}, "options ['root'] are not taken"),
        ]:  # fmt: skip
            status, text = _post(url + "/init_weight_transfer_engine",
                                 {"init_info": {**info, **extra}}, token)  # fmt: skip
            assert status != 200 and refusal in text, (status, text)
    finally:
        theirs.finalize()
    server = VLLMServer(url, timeout=120, token=token)
    status, text = _post(url + "/collective_rpc", {"method": "rlwire_weight_versions"}, token)
    assert json.loads(text)["results"] == [
        {"backend": None, "held": None, "staged": None, "rlwire": True}
    ]  # joined no group, holds the model's own weights
    # the run's own path: the token joins, an update lands
    ours = registry.new("shm", is_master=True, bucket_size="1MiB", timeout=60)
    metadata = ours.prepare()
    failed: list[BaseException] = []

    def run(call) -> threading.Thread:
        def target() -> None:
            try:
                call()
            except BaseException as err:  # reported by the assertion below
                failed.append(err)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    try:
        joining = run(lambda: server.init_weight_transfer(
            "shm", rank=1, world_size=2, metadata=metadata, timeout=60))  # fmt: skip
        ours.init_process_group(rank=0, world_size=2, master_metadata=metadata)
        joining.join(180)
        assert not joining.is_alive() and not failed, failed
        weights = {k: v * 1.05 for k, v in load_file(model_dir / "model.safetensors").items()}
        versions: list[int] = []
        receiving = run(lambda: versions.append(server.receive_update()))
        asyncio.run(ours.send_weights(weights.items(), version=1))
        receiving.join(180)
        assert not receiving.is_alive() and not failed and versions == [1], failed
        server.finish_update(1)
    finally:
        ours.finalize()
    status, text = _post(url + "/collective_rpc", {"method": "rlwire_weight_versions"}, token)
    assert json.loads(text)["results"][0]["held"] == 1


def test_a_server_that_does_not_answer_stops_the_run_naming_it(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    code, out = run_cli(
        tmp_path / "run",
        "rollout.backend=vllm_server",
        f"rollout.server_urls=[{url}]",
        cluster=ray_cluster,
    )
    assert code != 0
    assert f"vllm_server {url}: no answer to /v1/models" in out


def test_a_fully_async_run_on_a_vllm_server_continues_requests_across_syncs(ray_cluster, tmp_path):
    """The trainer starts the server (on the rollout worker's node) and generates through it
    with partial rollouts, each request a chain of completion calls of 2 tokens, syncing
    every step over the weight-transfer routes with calls in flight: each step but the last
    (which has no next one to generate for) writes its update in, samples continue across
    syncs (their tokens of two versions) within the staleness bound, the log-probs of
    chained calls are the actor's where no update came between (step 1), and no server is
    left behind. Learning is not asserted: on 40 steps its reward rise ranged from +0.02
    (a CI run) to +0.35 between runs of the same seed, as thread timing orders the
    samples; the server's log-probs after each sync: the colocated run below."""
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    import subprocess

    run = tmp_path / "run"
    records, _ = train_cli(
        run,
        "rollout.backend=vllm_server",
        "trainer.mode=fully_async",
        "trainer.steps=8",
        "async.partial_rollout_chunk_tokens=2",
        cluster=ray_cluster,
    )
    assert [r["weight_version"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 7]
    assert all(r["version_lag_max"] <= 1 for r in records), records
    assert records[0]["version_lag_max"] == 0 and abs(records[0]["kl_rollout"]) < 1e-3
    assert any(r["continued_fraction"] > 0 for r in records)
    assert max(r["version_span_max"] for r in records) == 1
    # The server gets SIGTERM as its worker exits (its watchdog, or the watchdog's death) and
    # takes a few seconds to shut down: gone within a minute, not left running.
    import time

    pattern = "vllm.entrypoints.openai.api_server --model " + str(run)
    deadline = time.monotonic() + 60
    while True:
        left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        if not left.stdout.strip() or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert left.stdout.strip() == "", f"a vllm serve process is still running: {left.stdout}"
