"""The rlwire GRPO trainer (in progress): configuration and the GRPO objective so far.

The Ray-orchestrated job that composes ``rlwire.grad_sync``, ``rlwire.offload``
and ``rlwire.ckpt_engine`` (and the ``rlwire-train`` command) arrives with the
rest of its issue; see this package's README for what exists today.
"""

from __future__ import annotations

from .config import ConfigError, TrainerConfig, load_config, to_dict
from .grpo import aggregate, group_advantages, k3_kl, policy_loss

__all__ = [
    "ConfigError",
    "TrainerConfig",
    "aggregate",
    "group_advantages",
    "k3_kl",
    "load_config",
    "policy_loss",
    "to_dict",
]
