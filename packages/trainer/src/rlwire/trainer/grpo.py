"""GRPO: group-normalised advantages and the clipped policy loss.

Shapes: ``B`` sequences (``prompts x n`` samples, grouped consecutively), ``T``
response tokens; ``mask`` is 1 for real response tokens, 0 for padding.
"""

from __future__ import annotations

import torch

__all__ = ["aggregate", "group_advantages", "k3_kl", "policy_loss"]


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence advantages: reward minus its group's mean (over ``group_size``
    consecutive samples of one prompt), divided by the group's standard deviation
    (unbiased) plus ``eps`` when ``norm_by_std``.

    Args:
        rewards: ``(B,)`` float, ``B`` a multiple of ``group_size``.

    Returns:
        ``(B,)`` float32. A group whose rewards are all equal gets 0 everywhere.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards: shape {tuple(rewards.shape)} is not (B,) with B a multiple "
            f"of group_size={group_size}"
        )
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        denom = grouped.std(dim=1, keepdim=True) + eps
        centred = torch.where(
            denom > 0,
            centred / denom.clamp(min=torch.finfo(denom.dtype).tiny),
            torch.zeros_like(centred),
        )
    return centred.reshape(-1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce ``(B, T)`` per-token values to a scalar.

    ``token-mean``: sum over real tokens / number of real tokens.
    ``seq-mean-token-mean``: each sequence's token mean, then the mean over sequences.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.mean()
    raise ValueError(
        f"loss_agg: {mode!r} is not allowed; use 'token-mean' or 'seq-mean-token-mean'"
    )


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): ``exp(r) - r - 1``, ``r = ref - log``.

    Non-negative, unbiased, low variance (Schulman's estimator).
    """
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float,
    loss_agg: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip surrogate with sequence advantages broadcast over tokens.

    ``loss = agg(w * max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))``,
    ``ratio = exp(logprobs - old_logprobs)``, ``w`` the importance ``weights`` of an
    off-policy correction (:mod:`rlwire.trainer.correction`; 1 without).

    Args:
        logprobs, old_logprobs, mask: ``(B, T)``.
        advantages: ``(B,)``.
        weights: ``(B, T)``, detached, or None.

    Returns:
        ``(loss, clip_fraction)``: the scalar loss and the fraction of real
        tokens where the clipped term was the active one.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    clip_fraction = aggregate((clipped > unclipped).float(), mask, "token-mean")
    return aggregate(per_token, mask, loss_agg), clip_fraction.detach()
