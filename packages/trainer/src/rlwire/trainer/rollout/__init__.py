"""Rollout engines (``hf``, ``vllm``, ``vllm_server``, ``paced``; one module each, one seam)
and what they hand back.

Every engine serves requests (:mod:`.requests`: one continuation each, with its own seed
and per-token weight versions): ``hf`` and ``paced`` with continuous batching
(:mod:`.hf_batch`), ``vllm`` on vLLM's own (:mod:`.vllm_steps`), ``vllm_server`` as chains
of completion calls the server batches (:mod:`.chains`), and any engine with only
``extend`` through a lock-step core (:mod:`.lockstep`).

Add an engine by subclassing :class:`RolloutEngine` in a module of its own and naming it
in :data:`ROLLOUT_ENGINES`, or, outside this package, with
``rollout.backend=pkg.module:Class``. Imports ``models`` and the foundation only.
"""

from __future__ import annotations

from .base import (
    ROLLOUT_ENGINES,
    EngineLost,
    PartialRolloutEngine,
    RolloutEngine,
    SleepingRolloutEngine,
    StagingRolloutEngine,
    rollout_engine_class,
)
from .common import (
    Example,
    Rollout,
    Sampling,
    response_lengths,
    sequence_logprobs,
    split_evenly,
)
from .digest import WeightsDigest, weights_digest
from .hf import HFEngine, hf_extend, hf_generate, hf_start
from .tokens import completions_rollout, token_rollout

__all__ = [
    "ROLLOUT_ENGINES",
    "EngineLost",
    "Example",
    "HFEngine",
    "PartialRolloutEngine",
    "Sampling",
    "Rollout",
    "RolloutEngine",
    "SleepingRolloutEngine",
    "StagingRolloutEngine",
    "WeightsDigest",
    "completions_rollout",
    "hf_extend",
    "hf_generate",
    "hf_start",
    "token_rollout",
    "response_lengths",
    "rollout_engine_class",
    "sequence_logprobs",
    "split_evenly",
    "weights_digest",
]
