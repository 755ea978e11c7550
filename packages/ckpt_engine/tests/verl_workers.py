"""Ray workers for the verl tests (not a test module; imported by the Ray workers by name).

verl's own actor-side worker (``ActorRolloutRefWorker``, whose ``update_weights`` feeds the
checkpoint engine with ``get_per_tensor_param()``) and rollout-side worker
(``CheckpointEngineWorker``, whose ``update_weights`` hands ``receive_weights()`` to the
rollout server), with only what needs a GPU or a model replaced: the training engine by
versioned test weights, the rollout server by a recorder.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.distributed import initialize_global_process_group_ray
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.utils import ensure_async_iterator

BUCKET_MB = 1


def make_weights(version: int) -> dict[str, torch.Tensor]:
    """Different values per version: fp32, odd-length bf16, int64, and one tensor larger
    than a bucket (1 MiB)."""
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.norm": torch.randn(7, generator=g).to(torch.bfloat16),
        "layer.0.steps": torch.randint(0, 1000, (5,), generator=g),
        "lm_head.weight": torch.randn(512, 640, generator=g),  # 1.25 MiB > the bucket
    }


class _TrainEngine:
    def __init__(self) -> None:
        self.version = 0

    def get_per_tensor_param(self, **kwargs):
        return iter(make_weights(self.version).items()), None


def _new_engine(backend: str, engine_kwargs: dict, **role):
    return CheckpointEngineRegistry.new(
        backend, bucket_size=BUCKET_MB << 20, **role, **engine_kwargs.get(backend, {})
    )


class ActorWorker(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
        self.actor = SimpleNamespace(engine=_TrainEngine())
        self.checkpoint_engine = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_backend(self, backend: str, engine_kwargs: dict):
        """A new engine, built as verl's ``init_model`` builds it."""
        self.config.rollout.checkpoint_engine.backend = backend
        master = torch.distributed.get_rank() == 0
        self.checkpoint_engine = _new_engine(backend, engine_kwargs, is_master=master)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_version(self, version: int):
        self.actor.engine.version = version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_id(self):
        """The identity of the rlwire engine inside the adapter (None between groups)."""
        engine = getattr(self.checkpoint_engine, "engine", None)
        return None if engine is None else id(engine)


class _Recorder:
    """Stands in for the rollout server (vLLM's or SGLang's adapter)."""

    replica_rank, is_leader_rank = 0, True

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.steps: list[int | None] = []

    async def update_weights(self, weights, global_steps=None, **kwargs):
        self.received = {}
        async for name, tensor in ensure_async_iterator(weights):
            self.received[name] = tensor.clone()
        self.steps.append(global_steps)


class RolloutWorker(CheckpointEngineWorker):
    def __init__(self, rollout_config, model_config=None):
        super().__init__(rollout_config, model_config, server_adapter=_Recorder())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_backend(self, backend: str, engine_kwargs: dict):
        self.checkpoint_engine = _new_engine(backend, engine_kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self):
        return self.server_adapter.received, self.server_adapter.steps


class Replica:
    """What verl's manager uses of a rollout replica: its workers and four coroutines."""

    def __init__(self, workers) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request=False):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def resume_generation(self):
        return None
