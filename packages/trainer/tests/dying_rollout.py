"""Test helper (not a test module): a rollout engine whose process dies once, outright.

``rollout.backend=dying_rollout:DiesOnce``: the ``hf`` engine, except that rollout worker 1
SIGKILLs its own process at its second training generation (validation calls are not
counted), once per run directory (a file there remembers it), as a crashed or OOM-killed
worker does. Its replacement generates as ``hf`` does."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from rlwire.trainer.rollout.hf import HFEngine

DIES = (1, 2)
"""(worker index, training generation call number from 1)."""


class DiesOnce(HFEngine):
    name = "dying_rollout:DiesOnce"
    dies = DIES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def generate(self, prompts, seed, sampling=None):
        if sampling is None:
            self.calls += 1
        marker = Path(self.config.trainer.output_dir) / "rollout-died"
        if (self.index, self.calls) == self.dies and sampling is None and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(prompts, seed, sampling)


class OnlyWorkerDiesOnce(DiesOnce):
    """:class:`DiesOnce` for worker 0 (a run with one rollout worker: no survivor)."""

    name = "dying_rollout:OnlyWorkerDiesOnce"
    dies = (0, 2)
