"""The ``vllm_server`` rollout backend: generation on ``vllm serve`` servers over HTTP.

Each rollout worker drives one server: the one :class:`~.vllm_process.ServerProcess` starts on
the worker's node (``rollout.server_urls`` unset), or the running one at
``rollout.server_urls[index]``. The engine serves requests as chains of completion calls,
many in flight at once, which the server batches continuously (:mod:`.chains`; with partial
rollouts each call of at most ``async.partial_rollout_chunk_tokens`` tokens, so that a
weight commit waits for no more). A server it starts runs the rlwire engine of the run's
checkpoint-engine backend and takes weights from this run only (its token: :mod:`.vllm_http`);
a server given by URL is sent the ``RLWIRE_WEIGHT_TRANSFER_TOKEN`` of this worker's
environment, where set. Calls go through the OpenAI-compatible completions API
with token ids in and out: the prompt's token ids are sent, the sampled token ids
(``return_token_ids``) and their log-probabilities (``logprobs=0``; the server runs with
``--logprobs-mode processed_logprobs``: temperature applied, the quantity the actor
recomputes) come back; nothing is re-tokenized. Weight updates go through vLLM's
weight-transfer routes into the server's ``rlwire`` weight-transfer engine
(:mod:`rlwire.ckpt_engine.vllm`): the server's workers join the checkpoint engine's group
as this worker's receiver; an update is received beside the weights in use (deltas onto
the version the server holds) and written in at the commit, with no call in flight; the
prefix cache is reset then, so the next calls prefill with the new weights (always
``rollout.kv_on_update=recompute``: a server keeps no request between two calls).

A server that stops answering (``/health`` unanswered for ``rollout.vllm.health_timeout``,
a refused connection, a call past ``rollout.vllm.request_timeout``) is lost: the requests
in flight fail at once with :class:`~.base.EngineLost` and the job replaces the worker; a
replacement of a server given by URL (``rejoin``) waits for it with backoff.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import torch

from rlwire.ckpt_engine import WEIGHT_TRANSFER_TOKEN_ENV

from .base import EngineLost, RequestsEngine, StagingRolloutEngine
from .chains import chain_core
from .requests import Request
from .vllm_http import VLLMServer
from .vllm_process import ServerProcess
from .vllm_steps import vllm_sampling

__all__ = ["VLLMServerEngine"]


class VLLMServerEngine(RequestsEngine, StagingRolloutEngine):
    """``rollout.backend=vllm_server``: a ``vllm serve`` server per rollout worker."""

    name = "vllm_server"
    takes_deltas = True  # the server's weight-transfer engine keeps the version it holds
    rejoins = True

    def __init__(
        self,
        config,
        model_path: str,
        device: torch.device,
        *,
        gpu_share: float = 1.0,
        index: int = 0,
        rejoin: bool = False,
    ) -> None:
        super().__init__(config, model_path, device, gpu_share=gpu_share, index=index)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.process: ServerProcess | None = None
        cfg = config.rollout
        timeout = cfg.vllm.request_timeout
        if cfg.server_urls:
            # the user's server: its token, if it was started with one, from this worker's
            # environment (docs: rollout backends)
            url, token = cfg.server_urls[index], os.environ.get(WEIGHT_TRANSFER_TOKEN_ENV)
        else:
            self.process = ServerProcess.start(
                config, model_path, backend=config.ckpt_engine.backend, gpu_share=gpu_share
            )
            url, token = self.process.url, self.process.token
        self.server = VLLMServer(
            url, timeout=timeout, token=token, index=index, health_timeout=cfg.vllm.health_timeout
        )
        self._closing = threading.Event()
        try:
            if self.process is not None:
                self.process.wait_ready(self.server, config.ray.startup_timeout)
            elif rejoin:  # the server this worker lost: back once it answers
                self.server.wait_answering()
            self.server.check_serves(model_path, config.model.path, rejoin=rejoin)
        except BaseException:
            self.close()
            raise
        self.core = chain_core(
            self._call, eos=self.tokenizer.eos_token_id, config=config, index=index, name=self.name
        )
        self._watch = threading.Thread(
            target=self._watch_health,
            args=(cfg.vllm.health_timeout,),
            name=f"rlwire-vllm-health-{index}",
            daemon=True,
        )
        self._watch.start()

    def _watch_health(self, timeout: float) -> None:
        """Ask ``/health`` every few seconds; once it went unanswered for ``timeout``
        seconds (``rollout.vllm.health_timeout``), the engine is lost: every request and
        call in flight fails at once with :class:`~.base.EngineLost` (a stopped server
        would hold them for ``request_timeout``), and the job replaces this worker."""
        every = min(5.0, timeout / 3)
        answered, core = time.monotonic(), self.core
        assert core is not None  # started after it
        while not self._closing.wait(every):
            try:
                healthy = self.server.healthy()
            except Exception:  # never ends the watch silently: counted as no answer
                healthy = False
            if healthy:
                answered = time.monotonic()
            elif time.monotonic() - answered > timeout:
                core.fail(
                    EngineLost(
                        f"vllm_server {self.server.url}: no answer to /health for "
                        f"{time.monotonic() - answered:.0f} s (rollout.vllm.health_timeout: "
                        f"{timeout:g} s)",
                        self.index,
                    )
                )
                return

    def close(self) -> None:
        self._closing.set()
        if self.core is not None:
            self.core.close(timeout=5)
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
    def _body(
        self,
        prompt,
        *,
        max_tokens: int,
        seed: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> dict:
        eos = self.tokenizer.eos_token_id
        # Every processor that could change the distribution, neutral (as the vllm engine)
        return {
            "model": self.server.model_name,
            "prompt": prompt,
            "n": 1,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
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

    def _call(
        self, context: list[int], max_tokens: int, seed: int, request: Request
    ) -> tuple[list[int], list[float], str]:
        """One completion call of a request's chain (:mod:`.chains`)."""
        body = self._body(context, max_tokens=max_tokens, seed=seed, **vllm_sampling(request))
        return self.server.complete(body, expected=1)[0]
