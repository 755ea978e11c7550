"""The policy objective: per-token losses (PPO-clip with the dual clip, GSPO), the k3 KL, and
their aggregation over the whole mini-batch (verl's ``agg_loss``). The advantages:
:mod:`rlwire.trainer.algorithms.advantages`.

Shapes: ``B`` sequences, ``T`` response tokens; ``mask`` is 1 for the tokens that count
(real response tokens, less any an off-policy correction rejected), 0 otherwise.

A mini-batch is split over micro-batches and data-parallel ranks, whose gradients are
summed (micro-batches) and averaged (ranks). Each micro-batch's loss is therefore its
share of the mini-batch's: normalised by the mini-batch's token or sequence count over
every rank (:class:`LossScale`) and multiplied by the number of ranks, so that the
gradient is that of the whole mini-batch's aggregate, whatever the split.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LossScale", "aggregate", "k3_kl", "policy_loss"]


@dataclasses.dataclass(frozen=True, slots=True)
class LossScale:
    """What a micro-batch's loss is normalised by: the mini-batch's counted tokens and
    sequences (those with at least one counted token) over every rank, the number of
    ranks, and the horizon of ``seq-mean-token-sum-norm``."""

    tokens: float
    sequences: float
    world: int = 1
    horizon: int = 1

    @classmethod
    def of(cls, mask: torch.Tensor, *, world: int = 1, horizon: int | None = None) -> LossScale:
        """The counts of ``mask`` itself (one rank: the whole mini-batch is here)."""
        return cls(
            tokens=float(mask.sum()),
            sequences=float((mask.sum(dim=1) > 0).sum()),
            world=world,
            horizon=mask.shape[1] if horizon is None else horizon,
        )


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str, scale: LossScale | None = None
) -> torch.Tensor:
    """Reduce ``(B, T)`` per-token values to this micro-batch's share of the mini-batch's
    aggregate (verl's ``agg_loss``); ``scale`` None: ``mask`` is the whole mini-batch.

    - ``token-mean``: the sum over counted tokens / the mini-batch's tokens;
    - ``seq-mean-token-sum``: each sequence's token sum, summed / the mini-batch's sequences;
    - ``seq-mean-token-mean``: each sequence's token mean, summed / its sequences;
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / the horizon;

    each times the number of ranks (their gradients are averaged). Sequences without a
    counted token are not counted; an empty mini-batch gives 0.
    """
    scale = LossScale.of(mask) if scale is None else scale
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / max(scale.tokens, 1.0) * scale.world
    seq_tokens = mask.sum(dim=1)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_seq = (values * mask).sum(dim=1)
    elif mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(dim=1) / (seq_tokens + 1e-8)
    else:
        raise ValueError(
            f"loss_agg: {mode!r} is not allowed; use 'token-mean', 'seq-mean-token-sum', "
            "'seq-mean-token-mean' or 'seq-mean-token-sum-norm'"
        )
    counted = (seq_tokens > 0).to(values.dtype)
    loss = (per_seq * counted).sum() / max(scale.sequences, 1.0) * scale.world
    if mode == "seq-mean-token-sum-norm":
        loss = loss / scale.horizon
    return loss


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
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_mode: str = "vanilla",
    loss_agg: str = "token-mean",
    scale: LossScale | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate with sequence advantages broadcast over tokens.

    ``vanilla`` (PPO-clip): ``l = max(-A r, -A clip(r, 1 - lo, 1 + hi))`` per token with
    ``r = exp(clamp(logprobs - old_logprobs, -20, 20))``; with ``clip_ratio_c`` (the dual
    clip) ``l = min(l, -A c)`` where ``A < 0``. ``gspo``: the same clip on the sequence's
    length-normalised ratio ``s = exp(mean_t(logprobs - old_logprobs))`` (carried to each
    token as ``sg[s] x p_t / sg[p_t]``, its log clamped at 10), no dual clip. Then
    ``aggregate(w x l)`` with ``w`` the importance ``weights`` of an off-policy correction
    (:mod:`rlwire.trainer.algorithms.correction`; 1 without). ``clip_ratio`` is the lower range
    ``lo``; ``clip_ratio_high`` the upper (None: the same).

    Args:
        logprobs, old_logprobs, mask: ``(B, T)``.
        advantages: ``(B,)``.
        weights: ``(B, T)``, detached, or None.

    Returns:
        ``(loss, clip_fraction)``: this micro-batch's share of the loss (see
        :func:`aggregate`) and the fraction of its counted tokens where the clipped term
        was the active one.
    """
    low, high = clip_ratio, clip_ratio if clip_ratio_high is None else clip_ratio_high
    adv = advantages.unsqueeze(1)
    log_ratio = logprobs - old_logprobs
    if loss_mode == "gspo":
        lengths = mask.sum(dim=1).clamp(min=1)
        sequence = (log_ratio * mask).sum(dim=1) / lengths
        log_ratio = logprobs - logprobs.detach() + sequence.detach().unsqueeze(1)
        ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    elif loss_mode == "vanilla":
        ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        raise ValueError(f"loss_mode: {loss_mode!r} is not allowed; use 'vanilla' or 'gspo'")
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    per_token = torch.maximum(unclipped, clipped)
    if loss_mode == "vanilla" and clip_ratio_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(-adv * clip_ratio_c, per_token), per_token)
    if weights is not None:
        per_token = per_token * weights
    clip_fraction = aggregate((clipped > unclipped).float(), mask, "token-mean")
    return aggregate(per_token, mask, loss_agg, scale), clip_fraction.detach()
