"""The ``paced`` rollout engine: ``hf`` generation that takes a set wall time per decoding
step, waiting out the rest without using the CPU.

It stands for a rollout engine whose generation the trainer's CPUs do not pay for: a GPU
engine on devices of its own, or a remote inference server. Every step of its continuous
batch (one token for every request in flight, or a prefill of the requests joining)
returns no earlier than ``rollout.paced_step_s`` seconds after it started, whatever the
host's cores are doing; the samples, log-probs and weights are the ``hf`` engine's.
Benchmarks and tests use it to show whether the trainer overlaps generation with training
where generation, not the host, is the bottleneck.
"""

from __future__ import annotations

from .hf import HFEngine

__all__ = ["PacedEngine"]


class PacedEngine(HFEngine):
    """``rollout.backend=paced``: the ``hf`` engine, at least ``rollout.paced_step_s`` wall
    seconds per step of its continuous batch. It runs in a process of its own: its waits
    would stall a training rank."""

    name = "paced"
    hybrid = False

    def step_seconds(self) -> float:
        return self.config.rollout.paced_step_s
