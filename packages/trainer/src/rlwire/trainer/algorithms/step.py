"""The policy update on one actor rank: proximal log-probs, then PPO mini-batches, each one
optimizer step over micro-batches.

This is the piece every actor engine runs (FSDP2, FSDP1 or a plain module);
micro-batch accumulation goes through ``rlwire.grad_sync.run_micro_batches``,
so the configured sync policy (defer / every / auto) applies for real.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlwire.grad_sync import decide_policy, retained_grad_bytes, run_micro_batches

from ..rollout import Rollout, sequence_logprobs
from .losses import LossScale, aggregate, k3_kl, policy_loss
from .micro_batches import split_rows
from .padding_free import micro_batch_logprobs

__all__ = ["clip_and_step", "compute_old_logprobs", "grpo_update", "ppo_update"]

Rows = slice | torch.Tensor
"""A micro-batch: consecutive rows, or a token-budget group's row indices."""


def _micro_batches(rollout: Rollout, rows: int, max_tokens: int | None, group) -> Sequence[Rows]:
    """The rollout's micro-batches (:func:`rlwire.trainer.algorithms.micro_batches.split_rows`)."""
    return split_rows(
        rollout.prompt_mask, rollout.response_mask, rows=rows, max_tokens=max_tokens, group=group
    )


def _logprobs(
    model,
    rollout: Rollout,
    rows: Rows,
    *,
    temperature: float,
    with_entropy: bool,
    remove_padding: bool,
):
    """``rows``' ``(b, T)`` log-probs (and entropies): padded to the whole batch's prompt
    and response widths for consecutive rows (fixed micro-batches), else trimmed to the
    rows' own, or packed with ``remove_padding``
    (:func:`rlwire.trainer.algorithms.padding_free.micro_batch_logprobs`)."""
    ids, mask, response = (
        rollout.prompt_ids[rows],
        rollout.prompt_mask[rows],
        rollout.response_ids[rows],
    )
    if isinstance(rows, slice) and not remove_padding:
        return sequence_logprobs(
            model, ids, mask, response, temperature=temperature, with_entropy=with_entropy
        )
    return micro_batch_logprobs(
        model,
        ids,
        mask,
        response,
        rollout.response_mask[rows],
        temperature=temperature,
        with_entropy=with_entropy,
        remove_padding=remove_padding,
    )


@torch.no_grad()
def compute_old_logprobs(
    model,
    rollout: Rollout,
    *,
    micro_batch_size: int,
    temperature: float,
    max_tokens: int | None = None,
    remove_padding: bool = False,
    group=None,
) -> torch.Tensor:
    """``(B, T)`` log-probs of the rollout under the current actor (forward only), 0 where
    ``response_mask`` is.

    Micro-batches of ``micro_batch_size`` rows, or with ``max_tokens`` token-budget
    micro-batches (:func:`rlwire.trainer.algorithms.micro_batches.split_rows`: a collective over
    ``group`` when ``torch.distributed`` is initialised), their results put back in row
    order; ``remove_padding`` packs each micro-batch into one row
    (:mod:`rlwire.trainer.algorithms.padding_free`).
    """
    out = torch.zeros_like(rollout.response_mask, dtype=torch.float32)
    for rows in _micro_batches(rollout, micro_batch_size, max_tokens, group):
        out[rows] = _logprobs(
            model,
            rollout,
            rows,
            temperature=temperature,
            with_entropy=False,
            remove_padding=remove_padding,
        ).float()
    return out * rollout.response_mask


def grpo_update(
    model,
    optimizer: torch.optim.Optimizer | None,
    rollout: Rollout,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float,
    clip_ratio: float,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_mode: str = "vanilla",
    loss_agg: str = "token-mean",
    entropy_coeff: float = 0.0,
    scale: LossScale | None = None,
    grad_clip: float = 1.0,
    grad_sync: object = "defer",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    optimizer_step: Callable[[], float] | None = None,
    weights: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
    max_tokens: int | None = None,
    remove_padding: bool = False,
    group=None,
) -> dict[str, Any]:
    """One optimizer step over this rank's share of the rollout.

    ``old_logprobs`` None: the update is exactly on-policy (see
    ``TrainerConfig.reuses_training_logprobs``), so the proximal log-probs are each
    micro-batch's own training forward, detached (what :func:`compute_old_logprobs`
    would return, without its forward pass); they are written into ``record``
    (``(B, T)``) when given, for the metrics that need them.

    Each micro-batch's loss is its share of the mini-batch's aggregate
    (:func:`rlwire.trainer.algorithms.losses.aggregate`, normalised by ``scale``: the mini-batch's
    counts over every rank; None: this call's rows are the whole mini-batch), so the
    accumulated gradient is the mini-batch's. The loss is ``policy_loss`` (``loss_mode``,
    the clip ranges ``clip_ratio`` / ``clip_ratio_high`` and the dual clip
    ``clip_ratio_c``), minus ``entropy_coeff`` times the entropy, plus ``kl_coef`` times
    the k3 KL to the reference policy (with ``ref_logprobs``), each aggregated alike.
    ``weights`` and ``loss_mask`` (``(B, T)``) are an off-policy correction's
    (:func:`rlwire.trainer.algorithms.correction.correction_weights`): a factor on every token's
    loss term, and the response mask less the rejected tokens.
    ``optimizer_step`` replaces the default clip-step-zero sequence
    (:func:`clip_and_step`) with an actor engine's own
    (:meth:`rlwire.trainer.actor.ActorEngine.optimizer_step`); it returns the gradient norm.

    Micro-batches: ``micro_batch_size`` consecutive rows, each padded to this call's longest
    prompt and response; or with ``max_tokens`` (verl's ``use_dynamic_bsz``) token-budget
    groups of rows balanced by real tokens, each trimmed to its own longest prompt and
    response, as many on every rank of ``group`` (one all-reduce when ``torch.distributed``
    is initialised; every rank must call); ``remove_padding`` packs each micro-batch into
    one row (:mod:`rlwire.trainer.algorithms.padding_free`). The loss and gradient are the same
    whatever the split (up to floating-point rounding); ``clip_fraction`` and ``entropy``
    are per-micro-batch means weighted by rows, so they move slightly with it.
    Returns metrics: ``policy_loss``, ``clip_fraction``, ``entropy``, ``kl_ref``
    (0 without a reference), ``grad_norm``, ``retained_grad_bytes`` (the most
    held between micro-batches) and ``grad_sync_policy``.
    """
    total = rollout.response_ids.shape[0]
    if scale is None:
        scale = LossScale.of(rollout.response_mask if loss_mask is None else loss_mask)
    parts = _micro_batches(rollout, micro_batch_size, max_tokens, group)
    held: list[int] = []
    timing = {"forward_backward": 0.0}

    def step(s: Rows) -> tuple[float, float, float, float]:
        start = time.perf_counter()
        logp, entropy = _logprobs(
            model,
            rollout,
            s,
            temperature=temperature,
            with_entropy=True,
            remove_padding=remove_padding,
        )
        if old_logprobs is None:  # on-policy: this forward's own, as compute_old_logprobs'
            old = logp.detach() * rollout.response_mask[s]
            if record is not None:
                record[s] = old
        else:
            old = old_logprobs[s]
        mask = (rollout.response_mask if loss_mask is None else loss_mask)[s]
        loss, clip_frac = policy_loss(
            logp,
            old,
            advantages[s],
            mask,
            clip_ratio=clip_ratio,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            loss_mode=loss_mode,
            loss_agg=loss_agg,
            scale=scale,
            weights=None if weights is None else weights[s],
        )
        if entropy_coeff > 0:
            loss = loss - entropy_coeff * aggregate(entropy, mask, loss_agg, scale)
        kl = torch.zeros(())
        if ref_logprobs is not None and kl_coef > 0:
            kl = aggregate(k3_kl(logp, ref_logprobs[s]), mask, loss_agg, scale)
            loss = loss + kl_coef * kl
        loss.backward()  # already its share of the mini-batch's aggregate
        held.append(retained_grad_bytes(model))
        timing["forward_backward"] += time.perf_counter() - start
        size = s.stop - s.start if isinstance(s, slice) else s.numel()
        weight = size / total  # for the per-row metrics
        return (
            loss.item(),
            clip_frac.item() * weight,
            aggregate(entropy.detach(), mask, "token-mean").item() * weight,
            kl.item(),
        )

    results = run_micro_batches(model, parts, step, policy=grad_sync)
    start = time.perf_counter()
    if optimizer_step is not None:
        grad_norm = optimizer_step()
    else:
        assert optimizer is not None, "grpo_update: an optimizer or an optimizer_step"
        grad_norm = clip_and_step(model, optimizer, grad_clip)
    optimizer_s = time.perf_counter() - start
    return {
        "policy_loss": sum(r[0] for r in results),
        "clip_fraction": sum(r[1] for r in results),
        "entropy": sum(r[2] for r in results),
        "kl_ref": sum(r[3] for r in results),
        "grad_norm": float(grad_norm),
        "retained_grad_bytes": max(held),
        "grad_sync_policy": str(decide_policy(model, grad_sync)),
        "time_forward_backward_s": timing["forward_backward"],
        "time_optimizer_s": optimizer_s,
    }


def ppo_update(
    rollout: Rollout,
    proximal: torch.Tensor | None,
    *,
    mini_batch_size: int,
    epochs: int,
    update: Callable[..., dict[str, Any]],
    scale_of: Callable[[torch.Tensor], LossScale] | None = None,
    **per_row: torch.Tensor | None,
) -> dict[str, Any]:
    """``epochs`` passes over the rollout in mini-batches of ``mini_batch_size`` rows, one
    optimizer step each (verl's ``ppo_mini_batch_size`` and ``ppo_epochs``).

    ``update`` is :func:`grpo_update` with everything but the rows bound; ``per_row`` are
    its ``(B, ...)`` tensor arguments (``advantages``, ``ref_logprobs``, ``weights``,
    ``loss_mask``; None passes through), cut to each mini-batch like the rollout;
    ``scale_of`` gives each mini-batch's :class:`~rlwire.trainer.algorithms.losses.LossScale` from
    its
    loss mask on this rank (over every rank: a collective; None: this rank's). Returns
    the steps' mean ``policy_loss``, ``clip_fraction``, ``entropy``, ``kl_ref`` and
    ``grad_norm``, the most ``retained_grad_bytes``, the ``grad_sync_policy``,
    ``optimizer_steps`` and the summed ``time_forward_backward_s`` and ``time_optimizer_s``.
    ``proximal`` None: on-policy, each step's own forward (one mini-batch, one epoch).
    """
    total = len(rollout)
    steps = []
    for _ in range(epochs):
        for start in range(0, total, mini_batch_size):
            rows = slice(start, min(start + mini_batch_size, total))
            cut = {k: None if v is None else v[rows] for k, v in per_row.items()}
            old = None if proximal is None else proximal[rows]
            part = rollout.select(rows)
            loss_mask = cut.get("loss_mask")
            mask = part.response_mask if loss_mask is None else loss_mask
            scale = None if scale_of is None else scale_of(mask)
            steps.append(update(rollout=part, old_logprobs=old, scale=scale, **cut))
    means = ("policy_loss", "clip_fraction", "entropy", "kl_ref", "grad_norm")
    sums = ("time_forward_backward_s", "time_optimizer_s")
    return {
        **{k: sum(m[k] for m in steps) / len(steps) for k in means},
        **{k: sum(m[k] for m in steps) for k in sums},
        "retained_grad_bytes": max(m["retained_grad_bytes"] for m in steps),
        "grad_sync_policy": steps[-1]["grad_sync_policy"],
        "optimizer_steps": len(steps),
    }


def clip_and_step(model, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip to ``grad_clip`` (0: no clipping) by the norm of the whole gradient, step, zero.

    For plain modules and FSDP2 (whose ``DTensor`` gradients reduce their norm over the
    mesh); engines whose gradients are local shards (FSDP1) bring their own step.
    """
    max_norm = grad_clip if grad_clip > 0 else math.inf  # inf: the norm, grads unchanged
    clip_params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(clip_params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
