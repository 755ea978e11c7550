"""rlwire's backends as vLLM weight-transfer engines (marked ``vllm``: run by ``.ci/vllm`` in
an environment with vLLM's CPU build and the rlwire wheels; deselected by default).

The real thing: a tiny Qwen2 model served by ``vllm.LLM`` and by a ``vllm serve`` process,
updated through vLLM's own trainer-side API (``WeightTransferTrainerFactory``) and its
weight-transfer routes; what vLLM serves after each update is compared bit for bit with the
same weights loaded through vLLM's own reload path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
PROMPT = [1, 5, 9, 17, 33, 2, 8]


def _qwen2(directory: Path, *, tied: bool) -> Path:
    """A tiny Qwen2 (fp32; head size 64, which vLLM's CPU attention takes; two heads: tensor
    parallelism 2 splits them); ``tied``: embeddings tied to the head (as Qwen2.5-0.5B to 3B
    are: the checkpoint has no ``lm_head.weight``)."""
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """:func:`_qwen2`, untied."""
    return _qwen2(tmp_path_factory.mktemp("vllm") / "tiny", tied=False)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """:func:`_qwen2`, tied."""
    return _qwen2(tmp_path_factory.mktemp("vllm") / "tied", tied=True)


@pytest.fixture(scope="module")
def vllm_env():
    """The engines' environment; their ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``) in a private
    directory of this module's, removed after it: by default vLLM leaves them in /tmp."""
    rpc = tempfile.mkdtemp(prefix="rlwire-test-vllm-rpc-")
    yield {
        **os.environ,
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # vLLM's weight-transfer routes
        "VLLM_RPC_BASE_PATH": rpc,
    }
    shutil.rmtree(rpc, ignore_errors=True)


def test_vllm_loads_the_rlwire_engines_as_a_plugin_and_keeps_its_own(vllm_env):
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    code = (
        "import sys, json\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.weight_transfer import WeightTransferEngineFactory as W\n"
        "from vllm.distributed.weight_transfer import WeightTransferTrainerFactory as T\n"
        "before = 'rlwire.ckpt_engine.vllm' in sys.modules\n"
        "load_general_plugins()\n"
        "keys = [k for k in W._registry if k.startswith('rlwire') or k in ('nccl', 'ipc')]\n"
        "print(json.dumps({'before': before,\n"
        "  'workers': {k: (W._registry[k]().__module__, W._registry[k]().__name__)\n"
        "              for k in keys},\n"
        "  'trainers': {k: T._registry[k]().__name__ for k in keys if k in T._registry}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=vllm_env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] is False  # the entry point did it, not an import of ours
    ours = {k for k in seen["workers"] if k.startswith("rlwire")}
    # no CUDA here; "rlwire" on the vLLM side: the trainer's init info names the backend
    assert ours == {"rlwire", "rlwire_gloo", "rlwire_shm", "rlwire_filesystem"}
    for name in ours:
        assert seen["workers"][name] == [
            "rlwire.ckpt_engine.vllm._worker",
            "RlwireWeightTransferEngine",
        ]
    assert {k for k in seen["trainers"] if k.startswith("rlwire")} == ours - {"rlwire"}
    assert all(seen["trainers"][k] == "RlwireTrainerEngine" for k in ours - {"rlwire"})
    # vLLM's own engines are untouched
    assert seen["workers"]["nccl"] == [
        "vllm.distributed.weight_transfer.nccl_engine",
        "NCCLWeightTransferEngine",
    ]
    assert seen["workers"]["ipc"][1] == "IPCWeightTransferEngine"
    assert seen["trainers"]["nccl"] == "NCCLTrainerWeightTransferEngine"


def test_bad_trainer_settings_are_refused_with_what_is_allowed():
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    from rlwire.ckpt_engine.vllm import RlwireTrainerInitInfo

    with pytest.raises(ValueError, match="'rlwire_tcp' is not an rlwire one; use rlwire_gloo"):
        RlwireTrainerInitInfo(backend="rlwire_tcp", rank=0)
    with pytest.raises(ValueError, match="receivers: 0 is not allowed; use an int >= 1"):
        RlwireTrainerInitInfo(rank=0, receivers=0)
    with pytest.raises(ValueError, match="delta"):
        RlwireTrainerInitInfo(rank=0, delta="sometimes")


def test_a_new_group_drops_an_update_the_old_one_left_unwritten():
    """A server whose earlier run died between receive and finish_weight_update: the next
    run's init drops that update (before: every receive refused "version 1 is received and
    not yet written in"). No vLLM engine runs: the transfer engine alone, on gloo."""
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    import asyncio
    import threading
    from types import SimpleNamespace

    import torch

    from rlwire.ckpt_engine import registry
    from rlwire.ckpt_engine.vllm import RlwireWeightTransferEngine
    from rlwire.ckpt_engine.vllm._worker import RlwireInitInfo

    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
    receiver = RlwireWeightTransferEngine(
        SimpleNamespace(backend="rlwire"), vllm_config, torch.device("cpu"), torch.nn.Linear(2, 2)
    )
    weights = [("w", torch.arange(6, dtype=torch.float32))]

    def run(version: int) -> int:
        """A run's sender joins with ``receiver`` and sends ``version``; what it received."""
        master = registry.new("gloo", is_master=True, timeout=30)
        meta = master.prepare()
        joined = threading.Thread(
            target=master.init_process_group,
            kwargs={"rank": 0, "world_size": 2, "master_metadata": meta},
        )
        joined.start()
        receiver.init_transfer_engine(
            RlwireInitInfo(backend="rlwire_gloo", master_metadata=meta, world_size=2, timeout=30)
        )
        joined.join(timeout=60)
        assert not joined.is_alive()

        async def both() -> int:
            _, received = await asyncio.gather(
                master.send_weights(weights, version=version), receiver.receive(version)
            )
            return received

        try:
            return asyncio.run(both())
        finally:
            master.finalize()

    try:
        assert run(1) == 1 and receiver.staged_version == 1  # the run dies here
        assert run(2) == 2 and receiver.staged_version == 2  # the next run's first update
    finally:
        receiver.shutdown()


BACKENDS = ["shm", "gloo", "filesystem"]


# vLLM's log-probs of the tiny fp32 model against a Hugging Face forward of the same weights:
# measured below 1e-6; a stale head after an update of x1.05 was off by 0.05 to 0.16
TOLERANCE = 1e-4


def _close_to_hf(seen: dict) -> bool:
    """Whether what vLLM served is the Hugging Face forward of the weights sent."""
    return max(abs(a - b) for a, b in zip(seen["logprobs"], seen["hf"], strict=True)) < TOLERANCE


@pytest.fixture(scope="module", params=["untied", "tied"])
def transfers(request, vllm_env) -> tuple[subprocess.CompletedProcess, dict[str, dict], bool]:
    """One ``vllm.LLM`` (the generic ``rlwire`` backend) updated through each backend in
    turn (``vllm_transfer.py``), on the untied model and on the tied one: the process,
    each backend's report and whether the model is tied."""
    model = request.getfixturevalue(f"{request.param}_model".replace("untied_", "tiny_"))
    out = subprocess.run(
        [sys.executable, str(HERE / "vllm_transfer.py"), str(model), *BACKENDS],
        capture_output=True,
        text=True,
        timeout=400,
        env=vllm_env,
    )
    reports = {}
    for line in out.stdout.splitlines():
        if line.startswith("REPORT "):
            backend, _, body = line[len("REPORT ") :].partition(" ")
            reports[backend] = json.loads(body)
    return out, reports, request.param == "tied"


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_versions_reach_vllm_LLM_bit_exact(transfers, backend):
    out, reports, tied = transfers
    assert backend in reports and out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    report = reports[backend]
    assert report["sender"] == "RlwireTrainerEngine"  # vLLM's factory built ours
    start, updates, reference = report["start"], report["updates"], report["reference"]
    # each backend's sender continues from the version the engine holds
    first = 4 * BACKENDS.index(backend) + 1
    assert [u["version"] for u in updates] == [str(first + k) for k in range(3)]
    assert _close_to_hf(start)
    for update, ref in zip(updates, reference, strict=True):
        # what vLLM serves is what a Hugging Face forward of the weights sent gives (a tied
        # head left at the old weights was not: vLLM's own reload below shares that defect)
        assert _close_to_hf(update), (update["logprobs"], update["hf"])
        # and equals the same weights through its own reload path, bit for bit
        assert update["tokens"] == ref["tokens"] and update["checksums"] == ref["checksums"]
        if not tied:  # (vLLM's reload leaves a tied head stale on CPU: not a reference)
            assert update["logprobs"] == ref["logprobs"]
    logprobs = [start["logprobs"]] + [u["logprobs"] for u in updates]
    assert all(a != b for a, b in zip(logprobs, logprobs[1:], strict=False))  # each changed them
    dense = updates[0]["bytes"]
    assert updates[0]["base"] is None and updates[0]["wire_bytes"] == dense
    if backend == "filesystem":  # whole snapshots only
        assert all(u["base"] is None for u in updates)
    else:  # 2% of the elements changed: a delta onto the version vLLM holds
        assert [u["base"] for u in updates[1:]] == [first, first + 1]
        assert all(u["wire_bytes"] < dense / 10 for u in updates[1:])
        # every layer rewritten when every tensor changed; only the changed layers (whole:
        # the fused qkv_proj takes k and v again) when one MLP and the query bias did
        names = updates[0]["written"][0][1]
        assert [u["written"][0] for u in updates[:2]] == [[names, names]] * 2
        part = 3 + 6  # layer 1's gate, up, down; layer 0's q, k, v weights and biases
        assert updates[2]["written"][0] == [part, names], updates[2]["written"]
    # an update cut off half-way: refused, named, and vLLM keeps serving the last version
    assert "the trainer died half-way" in report["cut_off"]
    assert f"vLLM keeps version {first + 2}" in report["cut_off"]
    after = report["after_cut_off"]
    assert after["version"] == str(first + 2) and after["logprobs"] == updates[-1]["logprobs"]
    assert after["checksums"] == updates[-1]["checksums"]
    # the next update lands (whole: the failed one left no base), here the original weights
    recovered = report["after_recovery"]
    assert recovered["version"] == str(first + 3) and recovered["base"] is None
    assert (
        recovered["logprobs"] == start["logprobs"] and recovered["checksums"] == start["checksums"]
    )


def test_with_tensor_parallelism_2_each_rank_takes_its_shard_deltas_included(tied_model, vllm_env):
    """Two worker processes (vLLM's ``mp`` executor), each an rlwire receiver; vLLM's loader
    takes each rank's shard of the checkpoint-format tensors (the tied model: each rank's
    head follows its shard of the embeddings). The CPU build binds one core per worker
    (``VLLM_CPU_OMP_THREADS_BIND``: it refuses two workers on one NUMA node)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism 2 binds a core per worker")
    out = subprocess.run(
        [sys.executable, str(HERE / "vllm_transfer.py"), str(tied_model), "shm", "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**vllm_env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("REPORT shm "))
    report = json.loads(line[len("REPORT shm ") :])
    start, (dense, delta, back) = report["start"], report["updates"]
    assert any(k.startswith("dp0:pp0:pcp0:tp1:") for k in start["checksums"])  # two ranks
    assert [u["version"] for u in (dense, delta, back)] == ["1", "2", "3"]
    assert dense["base"] is None and dense["logprobs"] != start["logprobs"]
    assert delta["base"] == 1 and delta["wire_bytes"] < delta["bytes"] / 10
    assert delta["logprobs"] != dense["logprobs"]
    # the model's own weights back: every rank exactly as it started
    assert back["tokens"] == start["tokens"] and back["logprobs"] == start["logprobs"]
    assert back["checksums"] == start["checksums"]
    assert all(_close_to_hf(u) for u in (start, dense, delta, back))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_vllm_serve_process_is_updated_over_http(tiny_model, vllm_env, tmp_path):
    import requests
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        WeightTransferTrainerFactory,
    )

    from rlwire.ckpt_engine.vllm import RlwireTrainerInitInfo

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init", "--seed", "0",
            "--kv-cache-memory-bytes", str(32 << 20),
            "--weight-transfer-config", '{"backend": "rlwire_shm"}',
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=vllm_env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            with contextlib.suppress(requests.ConnectionError):  # not listening yet
                if requests.get(f"{url}/health", timeout=5).ok:
                    break
            assert time.monotonic() < deadline, "vllm serve did not start within 240 s"
            time.sleep(1)

        def tokens() -> list[int]:
            body = {
                "model": str(tiny_model),
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            }
            answer = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()
            return answer["choices"][0]["token_ids"]

        def checksums() -> dict:
            body = {"action": "checksum"}
            return requests.post(f"{url}/weight_checker", json=body, timeout=60).json()["checksums"]

        def version() -> str:
            return requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"]

        start_tokens, start_sums = tokens(), checksums()
        info = RlwireTrainerInitInfo(backend="rlwire_shm", rank=0, delta="on", timeout=60)
        sender = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url, timeout=120)
        )
        base = load_file(tiny_model / "model.safetensors")
        changed = {name: t * 1.05 for name, t in base.items()}
        sender.send_weights(changed.items())
        assert version() == "1"
        assert tokens() != start_tokens and checksums() != start_sums
        # a sparse change: a delta over HTTP-driven updates
        nudged = {name: t.clone() for name, t in changed.items()}
        nudged["lm_head.weight"][3, :7] += 0.5
        stats = sender.send_weights(nudged.items())
        assert stats.base == 1 and stats.wire_bytes < stats.bytes / 100
        assert version() == "2"
        # and back to the model's own weights: exactly what the server started with
        sender.send_weights(base.items())
        assert version() == "3"
        assert tokens() == start_tokens and checksums() == start_sums
        sender.shutdown()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
