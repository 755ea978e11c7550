"""The ``algorithm`` section and the advantage estimators it chooses (verl's
``algorithm.adv_estimator``).

Every estimator here works on outcome rewards (one scalar per response) and returns one
advantage per response, the same for each of its tokens (verl's token-level result with a
discount of 1, which is the only one offered). ``B`` responses come in groups of ``n``
consecutive samples of one prompt; ``mask`` is the ``(B, T)`` response mask.

- ``grpo``: the reward minus its group's mean, divided by the group's standard deviation
  (unbiased) + 1e-6; without the division with ``norm_adv_by_std=false`` (Dr. GRPO).
- ``rloo``: the reward minus the mean of the group's other rewards (``n / (n - 1)`` times
  the reward minus the group mean).
- ``reinforce_plus_plus``: the reward whitened over the batch's tokens (each response
  weighs its number of tokens; unbiased variance, ``1e-8`` under the square root).
- ``reinforce_plus_plus_baseline``: the reward minus its group's mean, then whitened over
  the batch's tokens as above.

A group of one response has mean 0 (and standard deviation 1), as in verl.
"""

from __future__ import annotations

import dataclasses

import torch

from ..checks import check, check_choice
from .correction import RolloutCorrectionConfig
from .dynamic_sampling import FilterGroupsConfig
from .reward_kl import KL_PENALTIES, KLControlConfig

__all__ = [
    "ADV_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LOSS_MODES",
    "AlgorithmConfig",
    "compute_advantages",
    "group_advantages",
]

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
LOSS_MODES = ("vanilla", "gspo")


@dataclasses.dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """How rewards become advantages: ``grpo``, ``rloo``, ``reinforce_plus_plus`` or
    ``reinforce_plus_plus_baseline`` (verl's names and definitions; see
    :mod:`rlwire.trainer.algorithms.advantages`)."""
    norm_adv_by_std: bool = True
    """``grpo`` only: divide group-centred rewards by the group's standard deviation;
    False keeps the plain centred reward (Dr. GRPO)."""
    loss_mode: str = "vanilla"
    """The policy loss (verl's ``policy_loss.loss_mode``): ``vanilla`` (PPO-clip per token,
    with the dual clip) or ``gspo`` (the sequence-level, length-normalised ratio, clipped;
    no dual clip)."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon: ratios outside [1 - eps, 1 + eps] stop contributing."""
    clip_ratio_low: float | None = None
    """The lower clip range (``1 - clip_ratio_low``); None: ``clip_ratio``."""
    clip_ratio_high: float | None = None
    """The upper clip range (``1 + clip_ratio_high``; DAPO's clip-higher sets it above the
    lower one); None: ``clip_ratio``."""
    clip_ratio_c: float = 3.0
    """Dual clip (``vanilla``): for a negative advantage the loss is at most ``-A x c``, so a
    ratio far above 1 cannot push it without bound (verl's default 3)."""
    loss_agg: str = "token-mean"
    """How per-token losses become one number, over the whole mini-batch (all its
    micro-batches and ranks): ``token-mean`` (every token weighs the same),
    ``seq-mean-token-sum``, ``seq-mean-token-mean`` (per response, then the mean over
    responses) or ``seq-mean-token-sum-norm`` (token sums over responses divided by
    ``rollout.max_new_tokens``: Dr. GRPO's constant)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus: ``loss - entropy_coeff x entropy`` (aggregated as the
    loss is)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL loss to a frozen reference policy (the initial weights); 0 and
    ``use_kl_in_reward`` off turn the reference model off (not loaded, no forward pass)."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_ctrl``'s ``beta`` x the response's summed ``kl_penalty`` estimate from
    its reward before the advantages (:mod:`rlwire.trainer.algorithms.reward_kl`)."""
    kl_penalty: str = "kl"
    """The per-token estimate in the reward: ``kl``, ``abs``, ``mse`` or ``low_var_kl``."""
    kl_ctrl: KLControlConfig = dataclasses.field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = dataclasses.field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(
        default_factory=RolloutCorrectionConfig
    )

    def __post_init__(self) -> None:
        check_choice(self.adv_estimator, "algorithm.adv_estimator", ADV_ESTIMATORS)
        check_choice(self.loss_mode, "algorithm.loss_mode", LOSS_MODES)
        check_choice(self.loss_agg, "algorithm.loss_agg", LOSS_AGG_MODES)
        check(
            0 < self.clip_ratio < 1,
            "algorithm.clip_ratio",
            self.clip_ratio,
            "use a float in (0, 1)",
        )
        for key in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            check(value is None or value > 0, f"algorithm.{key}", value, "use a float > 0 or null")
        low = self.clip_low
        check(low < 1, "algorithm.clip_ratio_low", self.clip_ratio_low, "use a float in (0, 1)")
        check(self.clip_ratio_c > 1, "algorithm.clip_ratio_c", self.clip_ratio_c, "use a float > 1")
        check(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, "use a float >= 0")
        check_choice(self.kl_penalty, "algorithm.kl_penalty", KL_PENALTIES)
        check(
            not self.use_kl_in_reward or self.adv_estimator != "reinforce_plus_plus",
            "algorithm.use_kl_in_reward",
            True,
            "reinforce_plus_plus's returns would vary along the response (rlwire-train's "
            "advantages are one per response); use another estimator or turn it off",
        )
        check(
            self.entropy_coeff >= 0,
            "algorithm.entropy_coeff",
            self.entropy_coeff,
            "use a float >= 0",
        )

    @property
    def uses_reference(self) -> bool:
        """Whether the frozen reference policy is needed (the KL loss or the KL in reward)."""
        return self.kl_coef > 0 or self.use_kl_in_reward

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def _grouped_mean(grouped: torch.Tensor) -> torch.Tensor:
    """Each group's mean (0 for a group of one)."""
    if grouped.shape[1] == 1:
        return torch.zeros_like(grouped[:, :1])
    return grouped.mean(dim=1, keepdim=True)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: reward minus its group's mean (over ``group_size`` consecutive samples of one
    prompt), divided by the group's standard deviation (unbiased) + ``eps`` when
    ``norm_by_std``. A group whose rewards are all equal gets 0; a group of one keeps its
    reward (mean 0, standard deviation 1).

    Args:
        rewards: ``(B,)`` float, ``B`` a multiple of ``group_size``.

    Returns:
        ``(B,)`` float32.
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - _grouped_mean(grouped)
    if norm_by_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(centred)
        denom = std + eps  # 0 only with eps=0 and equal rewards: then 0, not 0/0
        centred = torch.where(denom > 0, centred / denom, torch.zeros_like(centred))
    return centred.reshape(-1)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards: shape {tuple(rewards.shape)} is not (B,) with B a multiple "
            f"of group_size={group_size}"
        )
    return rewards.float().view(-1, group_size)


def _rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    grouped = _grouped(rewards, group_size)
    if group_size == 1:
        return grouped.reshape(-1)
    n = group_size
    return (grouped * n / (n - 1) - grouped.mean(dim=1, keepdim=True) * n / (n - 1)).reshape(-1)


def _whiten_over_tokens(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` per-response values whitened over the batch's tokens (a response's value
    counted once per token): ``(x - mean) / sqrt(var + 1e-8)``, unbiased variance."""
    tokens = mask.float().sum(dim=1)
    total = tokens.sum()
    if total < 2:
        raise ValueError(
            f"reinforce_plus_plus needs at least 2 response tokens in the batch; got {int(total)}"
        )
    mean = (scores * tokens).sum() / total
    var = ((scores - mean) ** 2 * tokens).sum() / total * (total / (total - 1))
    return (scores - mean) * torch.rsqrt(var + 1e-8)


def compute_advantages(
    config: AlgorithmConfig, rewards: torch.Tensor, mask: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``(B,)`` advantages by ``config.adv_estimator`` (see the module docstring)."""
    estimator = config.adv_estimator
    if estimator == "grpo":
        return group_advantages(rewards, group_size, norm_by_std=config.norm_adv_by_std)
    if estimator == "rloo":
        return _rloo(rewards, group_size)
    if estimator == "reinforce_plus_plus":
        return _whiten_over_tokens(_grouped(rewards, group_size).reshape(-1), mask)
    grouped = _grouped(rewards, group_size)  # reinforce_plus_plus_baseline
    return _whiten_over_tokens((grouped - _grouped_mean(grouped)).reshape(-1), mask)
