"""The hybrid engine's Ray actor: a training rank with its rollout engine in its own process
(``rollout.hybrid_engine``, verl's hybrid engine)."""

from __future__ import annotations

import asyncio
from typing import Any

from ..config.root import TrainerConfig
from ..rollout import Example, Rollout, Sampling
from .rollout_worker import RolloutWorker
from .workers import ActorWorker

__all__ = ["HybridWorker"]


class HybridWorker(ActorWorker):
    """An actor rank with a rollout engine in its own process (``rollout.hybrid_engine``,
    verl's hybrid engine): every rank generates its share of the prompts and takes the
    weights from its own training engine in memory, through the ``naive`` checkpoint
    engine (each rank the sender of a group of two: itself and its rollout engine)."""

    def __init__(self, config: TrainerConfig, model_path: str, rank: int) -> None:
        super().__init__(config, model_path, rank)
        self.rollout = RolloutWorker(config, model_path, rank)

    def setup(self, master: tuple[str, int]) -> None:
        super().setup(master)
        self.rollout.load_engine()

    def generate(
        self, examples: list[Example], seed: int, sampling: Sampling | None = None
    ) -> Rollout:
        return self.rollout.generate(examples, seed, sampling)

    def sleep(self) -> None:
        self.rollout.sleep()

    def close(self) -> None:
        """Close this rank's rollout engine (:meth:`RolloutWorker.close`) before the job
        kills the process."""
        self.rollout.close()

    def wake_up(self) -> None:
        self.rollout.wake_up()

    def engine_init_hybrid(self) -> None:
        """This rank's in-process group: the training engine sends, the rollout engine
        receives, the tensors staying on this rank's device (no copy through the host)."""
        from rlwire.ckpt_engine import registry

        self.sync_device = self.device
        self._sends = True
        cfg = self.config.ckpt_engine
        self.engine = registry.new("naive", is_master=True, timeout=cfg.timeout)
        metadata = self.engine.prepare()
        self.engine.init_process_group(rank=0, world_size=2, master_metadata=metadata)
        self.rollout.engine_init("naive", 2, metadata, rank=1)

    def sync_weights(self, version: int) -> dict[str, Any]:
        """Hand the full weights to this rank's rollout engine as ``version`` (every rank
        gathers them); what :meth:`push_weights` reports, with the engine's ``pull``."""

        async def both():
            return await asyncio.gather(self._push(version), self.rollout._pull())

        push, pull = asyncio.run(both())
        return {**push, "pull": pull}
