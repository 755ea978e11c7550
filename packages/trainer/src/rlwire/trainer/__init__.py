"""The rlwire GRPO trainer: a Ray-orchestrated job composing the rlwire packages.

``rlwire-train`` (:mod:`.cli`) and the TRL-shaped Python API (:mod:`.api`:
``GRPOTrainer``) run it through :mod:`.driver`. By role, bottom to top
(each subpackage's docstring says what it may import; ``tests/test_layout.py`` checks it):
the foundation (:mod:`.errors`, :mod:`.checks`, :mod:`.plugins`); :mod:`.models`;
:mod:`.rollout` and :mod:`.agent` (engines and conversations); :mod:`.algorithms`;
:mod:`.actor`; :mod:`.data`; :mod:`.outputs`; :mod:`.config`; :mod:`.runtime` (the
processes); :mod:`.modes`; and :mod:`.tools` (benchmarks, checks, the fault campaign).
"""

from __future__ import annotations

from .algorithms.advantages import compute_advantages, group_advantages
from .algorithms.losses import aggregate, k3_kl, policy_loss
from .config.root import ConfigError, TrainerConfig, load_config, to_dict

__all__ = [
    "ConfigError",
    "GRPOConfig",
    "GRPOTrainer",
    "TrainerConfig",
    "aggregate",
    "compute_advantages",
    "group_advantages",
    "k3_kl",
    "load_config",
    "policy_loss",
    "to_dict",
]


def __getattr__(name: str):
    """``GRPOTrainer`` and ``GRPOConfig`` (:mod:`.api`), imported on first use: the API
    pulls in the whole job, which ``import rlwire.trainer`` does not need."""
    if name in ("GRPOTrainer", "GRPOConfig"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlwire.trainer' has no attribute {name!r}")
