"""The KL penalty in the reward (verl's ``algorithm.use_kl_in_reward``, ``kl_penalty`` and
``kl_ctrl``), beside the KL *loss* (``algorithm.kl_coef``).

Each response's reward loses ``beta x sum_t kl_t``, ``kl_t`` the chosen estimate between
the actor's log-probs before the update and the reference policy's, per response token:
for the sequence-level estimators here this is verl's token-level reward
``score - beta x kl_t`` summed over the response. ``beta`` is fixed, or adapted after each
step toward ``target_kl`` (Ziegler et al.; verl's ``AdaptiveKLController``): multiplied by
``1 + clip(kl / target_kl - 1, -0.2, 0.2) x batch / horizon``, ``kl`` the batch's mean of
each response's mean ``kl_t``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..checks import check, check_choice

__all__ = ["KL_PENALTIES", "KLControlConfig", "KLController", "kl_estimate", "kl_in_reward"]

KL_PENALTIES = ("kl", "abs", "mse", "low_var_kl")


@dataclasses.dataclass(kw_only=True, slots=True)
class KLControlConfig:
    type: str = "fixed"
    """``fixed`` (``beta = kl_coef``) or ``adaptive`` (toward ``target_kl``)."""
    kl_coef: float = 0.001
    """``beta``, or its start with ``adaptive``."""
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self) -> None:
        check_choice(self.type, "algorithm.kl_ctrl.type", ("fixed", "adaptive"))
        check(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", self.kl_coef, "use a float >= 0")
        check(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", self.target_kl, "use a float > 0")
        check(self.horizon >= 1, "algorithm.kl_ctrl.horizon", self.horizon, "use an int >= 1")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (verl's ``kl_penalty``): ``kl`` (k1, ``log p - log ref``),
    ``abs``, ``mse`` (k2, half the square) or ``low_var_kl`` (k3, clamped to [-10, 10])."""
    delta = logprobs - ref_logprobs
    if kind == "kl":
        return delta
    if kind == "abs":
        return delta.abs()
    if kind == "mse":
        return 0.5 * delta.square()
    if kind == "low_var_kl":
        r = torch.clamp(-delta, min=-20, max=20)
        return torch.clamp(torch.exp(r) - r - 1, min=-10, max=10)
    raise ValueError(f"kl_penalty: {kind!r} is not allowed; use one of {list(KL_PENALTIES)}")


class KLController:
    """``beta``: fixed, or adapted after every step (see the module docstring)."""

    def __init__(self, config: KLControlConfig, value: float | None = None) -> None:
        self.config = config
        self.value = config.kl_coef if value is None else value

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.config.type == "adaptive":
            error = min(max(current_kl / self.config.target_kl - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.config.horizon


def kl_in_reward(job, batch, rewards: torch.Tensor, extra: dict) -> tuple[torch.Tensor, dict]:
    """``rewards`` less ``beta`` x each response's summed KL estimate to the reference
    policy, computed on ``job``'s actor ranks (each on its shard); ``beta`` then adapts
    (``job.kl_ctrl``). The extras gain ``kl_in_reward`` (the batch's mean per-token
    estimate) and ``kl_in_reward_coef`` (the ``beta`` applied)."""
    tensors = dataclasses.replace(batch, texts=[], examples=[])
    refs = [a.reward_kl.remote(tensors.shard(r, job.world)) for r, a in enumerate(job.actors)]
    kl = torch.cat(job.call(refs, "KL to the reference policy"))
    beta = job.kl_ctrl.value
    current = float(kl[:, 1].mean())
    job.kl_ctrl.update(current, len(batch))
    out: dict[str, Any] = {**extra, "kl_in_reward": current, "kl_in_reward_coef": beta}
    return rewards - beta * kl[:, 0], out
