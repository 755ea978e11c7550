"""The ``paced`` rollout engine: ``hf`` generation that takes a set wall time per decoding
step, waiting out the rest without using the CPU.

It stands for a rollout engine whose generation the trainer's CPUs do not pay for: a GPU
engine on devices of its own, or a remote inference server. A call that decodes ``T``
tokens (its longest response) returns no earlier than ``T x rollout.paced_step_s`` seconds
after it started, whatever the host's cores are doing; the samples, log-probs and weights
are the ``hf`` engine's. Benchmarks and tests use it to show whether the trainer overlaps
generation with training where generation, not the host, is the bottleneck.
"""

from __future__ import annotations

import time

import torch

from .common import Rollout, Sampling
from .hf import HFEngine

__all__ = ["PacedEngine"]


class PacedEngine(HFEngine):
    """``rollout.backend=paced``: the ``hf`` engine, at least ``rollout.paced_step_s``
    wall seconds per decoding step of every call (``generate`` and, for partial rollouts,
    ``extend``). It runs in a process of its own: its waits would stall a training rank."""

    name = "paced"
    hybrid = False

    def _paced(self, began: float, steps: int) -> None:
        left = began + steps * self.config.rollout.paced_step_s - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def generate(self, prompts: list[str], seed: int, sampling: Sampling | None = None) -> Rollout:
        began = time.perf_counter()
        out = super().generate(prompts, seed, sampling)
        self._paced(began, out.response_ids.shape[1])
        return out

    def extend(
        self, batch: Rollout, max_new_tokens: int, seed: int
    ) -> tuple[Rollout, torch.Tensor]:
        began = time.perf_counter()
        grown, ended = super().extend(batch, max_new_tokens, seed)
        self._paced(began, grown.response_ids.shape[1] - batch.response_ids.shape[1])
        return grown, ended
