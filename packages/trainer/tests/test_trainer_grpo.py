"""GRPO math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlwire.trainer.algorithms.advantages import group_advantages
from rlwire.trainer.algorithms.losses import aggregate, k3_kl, policy_loss


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])  # groups of 2
    adv = group_advantages(rewards, 2, eps=0.0)
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); [0, 1] the mirror; [0.5, 0.5]: all 0
    s = math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0]))
    plain = group_advantages(rewards, 2, norm_by_std=False)
    torch.testing.assert_close(plain, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match=r"rewards: shape \(5,\) is not \(B,\) with B a multiple"):
        group_advantages(torch.zeros(5), 2)


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="loss_agg: 'sum' is not allowed"):
        aggregate(values, mask, "sum")


def test_clipped_loss_by_hand():
    # Two one-token sequences; old logprob 0. Ratios: e^0.5 = 1.6487 and e^-0.5 = 0.6065.
    logprobs = torch.tensor([[0.5], [-0.5]])
    old = torch.zeros(2, 1)
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2, 1)
    loss, clip_frac = policy_loss(logprobs, old, adv, mask, clip_ratio=0.2)
    # positive advantage: -min(r, clip(r)) -> seq 1: -1.2 (clipped), seq 2: -0.6065 (unclipped)
    expected = (-1.2 + -math.exp(-0.5)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert clip_frac.item() == pytest.approx(0.5)
    # negative advantage: -(-1) * max(r, clip(r)) -> seq 1: 1.6487, seq 2: 0.8 (clipped)
    loss, clip_frac = policy_loss(logprobs, old, -adv, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx((math.exp(0.5) + 0.8) / 2, rel=1e-6)
    assert clip_frac.item() == pytest.approx(0.5)


def test_loss_gradient_is_advantage_weighted_ratio_inside_the_clip_range():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(
        logprobs, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2), clip_ratio=0.2
    )
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0]]))  # -A * r / T


def test_k3_kl_by_hand():
    lp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([0.0, -0.5])
    kl = k3_kl(lp, ref)
    assert kl[0].item() == 0.0
    assert kl[1].item() == pytest.approx(math.exp(0.5) - 0.5 - 1)
