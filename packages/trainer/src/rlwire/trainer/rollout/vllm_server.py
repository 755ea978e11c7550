"""The ``vllm_server`` rollout backend: generation on ``vllm serve`` servers over HTTP.

Each rollout worker drives one server: the one :class:`~.vllm_http.ServerProcess` starts on
the worker's node (``rollout.server_urls`` unset), or the running one at
``rollout.server_urls[index]``. Generation goes through the OpenAI-compatible completions
API with token ids in and out: the prompt's token ids are sent, the sampled token ids
(``return_token_ids``) and their log-probabilities (``logprobs=0``; the server runs with
``--logprobs-mode processed_logprobs``: temperature applied, the quantity the actor
recomputes) come back; nothing is re-tokenized. Weight updates go through vLLM's
weight-transfer routes into the server's ``rlwire`` weight-transfer engine
(:mod:`rlwire.ckpt_engine.vllm`): the server's workers join the checkpoint engine's group
as this worker's receiver; an update is received beside the weights in use (deltas onto
the version the server holds) and written in at the commit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

import torch

from .base import PartialRolloutEngine, StagingRolloutEngine
from .common import Rollout, Sampling
from .tokens import Row, continuation_rows, token_rollout
from .vllm_http import ServerProcess, VLLMServer

__all__ = ["VLLMServerEngine"]


class VLLMServerEngine(PartialRolloutEngine, StagingRolloutEngine):
    """``rollout.backend=vllm_server``: a ``vllm serve`` server per rollout worker."""

    name = "vllm_server"
    takes_deltas = True  # the server's weight-transfer engine keeps the version it holds

    def __init__(
        self,
        config,
        model_path: str,
        device: torch.device,
        *,
        gpu_share: float = 1.0,
        index: int = 0,
    ) -> None:
        super().__init__(config, model_path, device, gpu_share=gpu_share, index=index)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.process: ServerProcess | None = None
        cfg = config.rollout
        timeout = cfg.vllm.request_timeout
        if cfg.server_urls:
            url = cfg.server_urls[index]
        else:
            self.process = ServerProcess.start(config, model_path, gpu_share=gpu_share)
            url = self.process.url
        self.server = VLLMServer(url, timeout=timeout)
        try:
            if self.process is not None:
                self.process.wait_ready(self.server, config.ray.startup_timeout)
            self.server.check_serves(model_path, config.model.path)
        except BaseException:
            self.close()
            raise
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="vllm-http")

    def close(self) -> None:
        if self.process is not None:
            self.process.stop()

    # --- weights ---------------------------------------------------------------------
    def join(self, backend: str, *, rank: int, world_size: int, metadata: dict):
        """The server's workers join the checkpoint engine's group as receiver ``rank``."""
        self.server.init_weight_transfer(
            backend, rank=rank, world_size=world_size, metadata=metadata,
            timeout=self.config.ckpt_engine.timeout,
        )  # fmt: skip
        return self.server

    async def stage(self, engine) -> Callable[[], int]:
        """Receive one whole update into the server beside the weights in use; the commit
        writes it in (``finish_weight_update``) and resets the prefix cache."""
        server: VLLMServer = engine
        version = await asyncio.to_thread(server.receive_update)

        def commit() -> int:
            server.finish_update(version)
            return version

        return commit

    def digest(self) -> str | None:
        return None  # the server's weights are repacked; updates are checked by log-probs

    # --- generation ------------------------------------------------------------------
    def _body(self, prompt, *, n: int, max_tokens: int, seed: int, temperature: float) -> dict:
        eos = self.tokenizer.eos_token_id
        # Every processor that could change the distribution, neutral (as the vllm engine)
        return {
            "model": self.server.model_name,
            "prompt": prompt,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": [eos] if eos is not None else [],
            "skip_special_tokens": False,
        }

    def _encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def generate(self, prompts: list[str], seed: int, sampling: Sampling | None = None) -> Rollout:
        cfg = self.config.rollout
        n, temperature = cfg.n, cfg.temperature
        if sampling is not None:  # vLLM samples greedily at temperature 0
            n, temperature = sampling.n, 0.0 if sampling.greedy else sampling.temperature
        ids = self._encode(prompts)
        body = self._body(ids, n=n, max_tokens=cfg.max_new_tokens, seed=seed,
                          temperature=temperature)  # fmt: skip
        choices = self.server.complete(body, expected=len(ids) * n)
        rows = [(ids[i // n], tokens, values) for i, (tokens, values, _) in enumerate(choices)]
        return token_rollout(self.tokenizer, rows)

    def start(self, prompts: list[str]) -> Rollout:
        n = self.config.rollout.n
        return token_rollout(
            self.tokenizer, [(p, [], []) for p in self._encode(prompts) for _ in range(n)]
        )

    def extend(
        self, batch: Rollout, max_new_tokens: int, seed: int
    ) -> tuple[Rollout, torch.Tensor]:
        rows = continuation_rows(batch)
        temperature = self.config.rollout.temperature

        def one(i: int, row: Row):
            body = self._body(row[0] + row[1], n=1, max_tokens=max_new_tokens, seed=seed + i,
                              temperature=temperature)  # fmt: skip
            return self.server.complete(body, expected=1)[0]

        outs = list(self._pool.map(one, range(len(rows)), rows))
        grown = [
            (p, r + tokens, lp + values)
            for (p, r, lp), (tokens, values, _) in zip(rows, outs, strict=True)
        ]
        ended = torch.tensor([finish == "stop" for _, _, finish in outs])
        return token_rollout(self.tokenizer, grown), ended
