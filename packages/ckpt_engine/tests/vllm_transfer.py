"""Run by test_ckpt_engine_vllm.py in a process of its own (an in-process vLLM engine
changes its host process): a tiny model served by ``vllm.LLM`` with an rlwire weight
transfer engine, updated through vLLM's trainer-side API; prints what it saw as JSON.

    python vllm_transfer.py MODEL_DIR BACKEND [BACKEND ...]  # one worker, in-process engine
    python vllm_transfer.py MODEL_DIR BACKEND --tp 2          # tensor parallelism 2 (processes)

Several backends: one after another into the same engine (started with the generic
``rlwire`` backend, which takes whichever the trainer's init info names), each through a
sender of its own whose versions continue from the last one vLLM holds: one process and one
engine serve them all (the three backends took 32 s so, 65 s in a process each).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

PROMPT = [1, 5, 9, 17, 33, 2, 8]


PART = ("layers.1.mlp.", "model.layers.0.self_attn.q_proj.bias")
"""What the third version changes: one layer's MLP and the query bias (of a fused
``qkv_proj``), so that a delta rewrites those layers only."""


def versions(base: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Three versions: all of it changed, then a few elements of every tensor, then a few
    elements of the :data:`PART` tensors only."""
    out = [{name: t * 1.05 for name, t in base.items()}]
    for step in (1, 2):
        g = torch.Generator().manual_seed(step)
        nxt = {}
        for name, t in out[-1].items():
            if step == 2 and not any(p in name for p in PART):
                nxt[name] = t
                continue
            t = t.clone()
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[idx] += 0.01 * step
            nxt[name] = t
        out.append(nxt)
    return out


def start_llm(model_dir: str, **options):
    """The tiny model in ``vllm.LLM`` (fp32, eager, no tokenizer, a 32 MiB KV cache)."""
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=32 << 20,
        **options,
    )


def seen(llm) -> dict:
    """What ``llm`` serves: 8 greedy tokens and their log-probs for one prompt, every
    worker's weight checksums (one dict: each key names its rank) and the weight version."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=PROMPT)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    sums: dict = {}
    for worker in llm.collective_rpc("compute_weight_checksums"):
        sums.update(worker)
    return {
        "tokens": list(out.token_ids),
        "logprobs": [step[t].logprob for t, step in zip(out.token_ids, out.logprobs, strict=True)],
        "checksums": sums,
        "version": llm.get_weight_version(),
        "written": llm.collective_rpc(_written),
    }


def _written(worker) -> list[int]:
    """Checkpoint tensors the worker's rlwire engine wrote in at the last update, of those held."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return list(getattr(engine, "written", (0, 0)))


_HF: dict = {}


def hf_logprobs(model_dir: str, weights: dict[str, torch.Tensor], seen_: dict) -> list[float]:
    """The log-probs of the tokens ``seen_`` names under a Hugging Face forward of
    ``weights`` (checkpoint format: a tied model's has no ``lm_head.weight``, which then
    follows ``embed_tokens``): what vLLM must serve, whatever its loader does."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = _HF[model_dir].eval()
    missing = model.load_state_dict(weights, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"} and (not missing or model.config.tie_word_embeddings)
    ids = torch.tensor([PROMPT + seen_["tokens"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(seen_["tokens"])]


def tensor_parallel(model_dir: str, backend: str, tp: int) -> None:
    """``tp`` worker processes, each a receiver taking its shard through vLLM's loader: a
    dense update, a delta, then the model's own weights back (what it started with)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from rlwire.ckpt_engine.vllm import LLMClient, RlwireTrainerInitInfo

    llm = start_llm(
        model_dir,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        weight_transfer_config={"backend": f"rlwire_{backend}"},
    )
    info = RlwireTrainerInitInfo(
        backend=f"rlwire_{backend}", rank=0, receivers=tp, delta="on", checksum=True, timeout=60
    )
    sender = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm))
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    start = seen(llm)
    report: dict = {"start": {**start, "hf": hf_logprobs(model_dir, base, start)}, "updates": []}
    changed = versions(base)
    for weights in (changed[0], changed[1], base):
        stats = sender.send_weights(weights.items())
        now = seen(llm)
        hf = hf_logprobs(model_dir, weights, now)
        moved = {"base": stats.base, "wire_bytes": stats.wire_bytes, "bytes": stats.bytes}
        report["updates"].append({**now, **moved, "hf": hf})
    sender.shutdown()
    print(f"REPORT {backend} " + json.dumps(report))


def main() -> None:
    model_dir, backends = sys.argv[1], sys.argv[2:]
    if "--tp" in sys.argv:
        tensor_parallel(model_dir, backends[0], int(sys.argv[sys.argv.index("--tp") + 1]))
        return
    llm = start_llm(
        model_dir,
        distributed_executor_backend="uni",
        seed=0,
        # the generic name: each sender's init info picks the backend
        weight_transfer_config={"backend": "rlwire"},
    )
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    for number, backend in enumerate(backends):
        report = one_backend(llm, base, backend, model_dir, first=4 * number + 1)
        print(f"REPORT {backend} " + json.dumps(report), flush=True)


def one_backend(llm, base, backend: str, model_dir: str, first: int) -> dict:
    """Three versions from ``first`` on, each compared with vLLM's own reload of the same
    weights, then an update cut off half-way and the next one landing."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from rlwire.ckpt_engine.vllm import LLMClient, RlwireTrainerInitInfo

    start = seen(llm)
    report: dict = {
        "start": {**start, "hf": hf_logprobs(model_dir, base, start)},
        "updates": [],
        "reference": [],
    }
    info = RlwireTrainerInitInfo(
        backend=f"rlwire_{backend}",
        rank=0,
        receivers=1,
        delta="on",
        checksum=True,
        timeout=5,
        options={"root": os.path.join(os.path.dirname(model_dir), "fs")}
        if backend == "filesystem"
        else {},
        bucket_size="64KiB",
    )
    if backend == "filesystem":
        info.delta = "off"
    sender = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm))
    report["sender"] = type(sender).__name__
    for version, weights in enumerate(versions(base), first):
        stats = sender.send_weights(weights.items(), version=version)
        now = seen(llm)
        report["updates"].append(
            {**now, "base": stats.base, "bytes": stats.bytes, "wire_bytes": stats.wire_bytes,
             "hf": hf_logprobs(model_dir, weights, now)}
        )  # fmt: skip
        # the same weights through vLLM's own reload path: what they must give
        llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": iter(list(weights.items())), "is_checkpoint_format": True},
        )
        report["reference"].append(seen(llm))

    # a cut-off update: the sender's weights stop half-way; vLLM keeps serving the last one
    def broken():
        for i, item in enumerate(base.items()):
            if i == len(base) // 2:
                raise RuntimeError("the trainer died half-way")
            yield item

    try:
        sender.send_weights(broken())
        report["cut_off"] = None
    except Exception as err:  # noqa: BLE001 - reported
        report["cut_off"] = str(err)
    report["after_cut_off"] = seen(llm)
    stats = sender.send_weights(base.items())  # and the next one lands (whole: no base held)
    report["after_recovery"] = {**seen(llm), "base": stats.base}
    sender.shutdown()
    return report


if __name__ == "__main__":
    main()
