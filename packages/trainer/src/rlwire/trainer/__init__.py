"""The rlwire GRPO trainer: a Ray-orchestrated job composing the rlwire packages.

``rlwire-train`` (:mod:`rlwire.trainer.cli`) runs it; :func:`load_config` builds
its configuration; :mod:`rlwire.trainer.algorithm` holds the advantages,
:mod:`rlwire.trainer.grpo` the objective, :mod:`rlwire.trainer.step` one actor update,
:mod:`rlwire.trainer.workers` and :mod:`rlwire.trainer.rollout_worker` the Ray actors and
:mod:`rlwire.trainer.driver` the loop.
"""

from __future__ import annotations

from .algorithm import compute_advantages, group_advantages
from .config import ConfigError, TrainerConfig, load_config, to_dict
from .grpo import aggregate, k3_kl, policy_loss

__all__ = [
    "ConfigError",
    "TrainerConfig",
    "aggregate",
    "compute_advantages",
    "group_advantages",
    "k3_kl",
    "load_config",
    "policy_loss",
    "to_dict",
]
