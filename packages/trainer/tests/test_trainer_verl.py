"""An oracle no one here wrote: the advantage estimators, the loss aggregation and the policy
losses against verl 0.9.1's own functions (``verl.trainer.ppo.core_algos``) on random
inputs with padding, all-equal groups and sequences without a counted token. Runs in the
verl environment (``.ci/verl``).

Where the definitions differ on purpose: verl's ``low_var_kl`` clamps the k3 estimate to
[-10, 10] (ours does not clamp: compared where it does not bind); with ``epsilon=0`` and an
all-equal group verl divides 0 by 0 (ours gives 0: verl's default epsilon 1e-6 is used here).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="needs verl: see .ci/verl")
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from rlwire.trainer.algorithms.advantages import (  # noqa: E402
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    AlgorithmConfig,
    compute_advantages,
)
from rlwire.trainer.algorithms.losses import LossScale, aggregate, k3_kl, policy_loss  # noqa: E402

pytestmark = pytest.mark.verl

GROUPS, N, T = 6, 4, 9


def _batch(seed: int):
    """Rewards (two groups all equal), lengths 1..T (a response mask with padding)."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (GROUPS * N,), generator=generator).float() / 2
    rewards[:N] = 1.0  # all equal
    rewards[N : 2 * N] = 0.0
    lengths = torch.randint(1, T + 1, (GROUPS * N,), generator=generator)
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    token_rewards = torch.zeros(GROUPS * N, T)
    token_rewards[torch.arange(GROUPS * N), lengths - 1] = rewards  # at the last token
    index = np.repeat(np.arange(GROUPS), N)
    return rewards, mask, token_rewards, index


def _verl_advantages(estimator: str, token_rewards, mask, index, norm: bool) -> torch.Tensor:
    config = types.SimpleNamespace(gamma=1.0)  # what reinforce_plus_plus reads
    if estimator == "grpo":
        out = core_algos.compute_grpo_outcome_advantage(
            token_rewards, mask, index, norm_adv_by_std_in_grpo=norm
        )
    elif estimator == "reinforce_plus_plus":
        out = core_algos.compute_reinforce_plus_plus_outcome_advantage(
            token_rewards, mask, config=config
        )
    else:
        fn = core_algos.get_adv_estimator_fn(estimator)
        out = fn(token_level_rewards=token_rewards, response_mask=mask, index=index, config=config)
    return out[0]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("estimator", "norm"), [*[(e, True) for e in ADV_ESTIMATORS], ("grpo", False)]
)
def test_advantages_match_verl(estimator, norm, seed):
    rewards, mask, token_rewards, index = _batch(seed)
    config = AlgorithmConfig(adv_estimator=estimator, norm_adv_by_std=norm)
    ours = compute_advantages(config, rewards, mask, N).unsqueeze(1) * mask
    theirs = _verl_advantages(estimator, token_rewards.clone(), mask, index, norm)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_matches_verls_agg_loss(mode):
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(8, T, generator=generator)
    mask = (torch.rand(8, T, generator=generator) > 0.4).float()
    mask[2] = 0  # a sequence without a counted token
    local = core_algos.agg_loss(values, mask, mode)
    torch.testing.assert_close(aggregate(values, mask, mode), local)
    # one micro-batch of a mini-batch spread over 4 ranks: verl's global batch info
    tokens, sequences = 57.0, 21.0
    theirs = core_algos.agg_loss(
        values,
        mask,
        mode,
        dp_size=4,
        batch_num_tokens=tokens,
        global_batch_size=sequences,
        loss_scale_factor=32,
    )
    scale = LossScale(tokens=tokens, sequences=sequences, world=4, horizon=32)
    torch.testing.assert_close(aggregate(values, mask, mode, scale), theirs)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_policy_losses_and_their_gradients_match_verl(loss_mode, mode):
    generator = torch.Generator().manual_seed(4)
    old = -torch.rand(8, T, generator=generator) * 3
    drift = torch.randn(8, T, generator=generator) * 0.6
    drift[0] = 2.5  # a ratio of e^2.5 > clip_ratio_c: the dual clip binds
    mask = (torch.arange(T) < torch.randint(1, T + 1, (8, 1), generator=generator)).float()
    advantages = torch.randn(8, generator=generator)
    advantages[0] = -1.0
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=N,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
    )
    ours_in = (old + drift).requires_grad_(True)
    theirs_in = (old + drift).requires_grad_(True)
    ours, _ = policy_loss(
        ours_in,
        old,
        advantages,
        mask,
        clip_ratio=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_mode=loss_mode,
        loss_agg=mode,
    )
    theirs, _ = core_algos.get_policy_loss_fn(loss_mode)(
        old, theirs_in, advantages.unsqueeze(1) * mask, mask, loss_agg_mode=mode, config=config
    )
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad)


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_estimates_in_the_reward_match_verl(kind):
    from rlwire.trainer.algorithms.reward_kl import kl_estimate

    generator = torch.Generator().manual_seed(6)
    logprobs = -torch.rand(4, T, generator=generator) * 2
    ref = logprobs + torch.randn(4, T, generator=generator) * 4  # the clamps bind somewhere
    theirs = core_algos.kl_penalty(logprobs, ref, kind)
    torch.testing.assert_close(kl_estimate(logprobs, ref, kind), theirs)


def test_the_adaptive_kl_controller_matches_verls():
    from rlwire.trainer.algorithms.reward_kl import KLControlConfig, KLController

    config = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.05, horizon=500)
    ours = KLController(config)
    theirs = core_algos.AdaptiveKLController(0.2, 0.05, 500)
    for kl in (0.0, 0.01, 0.049, 0.06, 0.5, 0.051):
        ours.update(kl, 64)
        theirs.update(kl, 64)
        assert ours.value == pytest.approx(theirs.value, rel=1e-12)


def test_k3_is_verls_low_var_kl_where_its_clamp_does_not_bind():
    generator = torch.Generator().manual_seed(5)
    logprobs = -torch.rand(4, T, generator=generator) * 2
    ref = logprobs + torch.randn(4, T, generator=generator) * 0.5
    theirs = core_algos.kl_penalty(logprobs, ref, "low_var_kl")
    torch.testing.assert_close(k3_kl(logprobs, ref), theirs)
