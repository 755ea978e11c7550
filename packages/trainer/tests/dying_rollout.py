"""Test helper (not a test module): a rollout engine whose process dies once, outright.

``rollout.backend=dying_rollout:DiesOnce``: the ``hf`` engine, except that rollout worker 1
SIGKILLs its own process at its second training generation (validation calls are not
counted; fully async: its second chunk of groups), once per run directory (a file there
remembers it), as a crashed or OOM-killed worker does. Its replacement generates as ``hf``
does."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rlwire.trainer.rollout import EngineLost
from rlwire.trainer.rollout.hf import HFEngine
from rlwire.trainer.rollout.paced import PacedEngine

DIES = (1, 2)
"""(worker index, training generation call number from 1)."""


class DiesOnce(HFEngine):
    name = "dying_rollout:DiesOnce"
    dies = DIES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.inside = False  # in generate(), whose requests are not counted again

    def _count(self) -> None:
        """One training generation (colocated and one-step off: a ``generate`` call; fully
        async: a chunk's ``submit_all``); the process dies at the chosen one."""
        self.calls += 1
        marker = Path(self.config.trainer.output_dir) / "rollout-died"
        if (self.index, self.calls) == self.dies and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    def generate(self, prompts, seed, sampling=None):
        if sampling is None:
            self._count()
        self.inside = True
        try:
            return super().generate(prompts, seed, sampling)
        finally:
            self.inside = False

    def submit_all(self, requests):
        if not self.inside:
            self._count()
        return super().submit_all(requests)


class DiesOnceThenValidating(DiesOnce):
    """:class:`DiesOnce`, and worker 0 dies in its second validation call (marker
    ``rollout-died-validating``): a death during a lock-step validation."""

    name = "dying_rollout:DiesOnceThenValidating"

    def generate(self, prompts, seed, sampling=None):
        if sampling is not None and self.index == 0:
            self.validations = getattr(self, "validations", 0) + 1
            marker = Path(self.config.trainer.output_dir) / "rollout-died-validating"
            if self.validations == 2 and not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(prompts, seed, sampling)


class OnlyWorkerDiesOnce(DiesOnce):
    """:class:`DiesOnce` for worker 0 (a run with one rollout worker: no survivor)."""

    name = "dying_rollout:OnlyWorkerDiesOnce"
    dies = (0, 2)


class PacedDiesOnce(DiesOnce, PacedEngine):
    """:class:`DiesOnce` over the ``paced`` engine (``rollout.paced_step_s`` a step)."""

    name = "dying_rollout:PacedDiesOnce"


class _DiesInSync:
    """A rollout engine whose worker ``sync_dies[0]`` SIGKILLs its process as it begins to
    receive its ``sync_dies[1]``-th weight update, once per run directory (the file
    ``sync_marker`` there remembers it): a death during a sync."""

    sync_dies = (1, 3)
    sync_marker = "rollout-died"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.syncs = 0

    async def stage(self, engine):
        self.syncs += 1
        marker = Path(self.config.trainer.output_dir) / self.sync_marker
        if (self.index, self.syncs) == self.sync_dies and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().stage(engine)


class DiesInSyncOnce(_DiesInSync, HFEngine):
    """The ``hf`` engine whose worker 1 dies as it receives its third weight update."""

    name = "dying_rollout:DiesInSyncOnce"


class PacedDiesInSync(_DiesInSync, PacedEngine):
    """The ``paced`` engine whose worker 0 dies as it receives its second weight update."""

    name = "dying_rollout:PacedDiesInSync"
    sync_dies = (0, 2)


class PacedDiesTwice(_DiesInSync, PacedDiesOnce):
    """:class:`PacedDiesOnce` (worker 1 dies in its second chunk of groups), and worker 0
    dies as it receives its third weight update (``rollout-died-in-sync``): in fully async,
    before worker 1's replacement has loaded, a sync with no member left (by hand: the docs'
    "Rollout workers that heal")."""

    name = "dying_rollout:PacedDiesTwice"
    sync_dies = (0, 3)
    sync_marker = "rollout-died-in-sync"


class LosesServerOnce(PacedDiesOnce):
    """The ``paced`` engine standing in for one that drives a server (``rejoins``): worker 1
    loses its engine in its second training generation (:class:`~rlwire.trainer.rollout.
    EngineLost`, as ``vllm_server`` does when its server stops answering; its process
    lives), once per run directory, and a replacement's engine waits for the "server" to
    answer again: :data:`DOWN_S` seconds after the loss."""

    name = "dying_rollout:LosesServerOnce"
    rejoins = True

    def __init__(self, *args, rejoin: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        marker = Path(self.config.trainer.output_dir) / "rollout-died"
        if rejoin:
            time.sleep(max(0.0, marker.stat().st_mtime + DOWN_S - time.time()))

    def _count(self) -> None:
        self.calls += 1
        marker = Path(self.config.trainer.output_dir) / "rollout-died"
        if (self.index, self.calls) == self.dies and not marker.exists():
            marker.write_text(str(os.getpid()))
            raise EngineLost(f"server of rollout worker {self.index}: no answer (a test)", 1)


DOWN_S = 2.0
"""Seconds :class:`LosesServerOnce`'s "server" stays down."""


class DiesInSetupOnce(HFEngine):
    """The ``hf`` engine whose worker 1 SIGKILLs its process as it joins the checkpoint
    engine's group for the first time (the run's start-up), once per run directory (the file
    ``rollout-died-in-setup`` there remembers it): a death while the weight group forms."""

    name = "dying_rollout:DiesInSetupOnce"

    def join(self, backend: str, *, rank: int, world_size: int, metadata: dict):
        marker = Path(self.config.trainer.output_dir) / "rollout-died-in-setup"
        if self.index == 1 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().join(backend, rank=rank, world_size=world_size, metadata=metadata)
