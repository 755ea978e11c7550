"""Off-policy correction by hand on small tensors: truncated and masked importance sampling at
token and sequence level, its metrics, its place in the loss, and the configuration keys."""

from __future__ import annotations

import math

import pytest
import torch

from rlwire.trainer.algorithms.correction import (
    GapWatch,
    RolloutCorrectionConfig,
    correction_weights,
)
from rlwire.trainer.algorithms.losses import policy_loss
from rlwire.trainer.config.root import ConfigError, load_config

# proximal - behaviour per token: rho = [[3, 0.25, pad], [1, 1.5, 1]]
RHO = torch.tensor([[3.0, 0.25, 7.0], [1.0, 1.5, 1.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -3.0]])
PROXIMAL = BEHAVIOUR + RHO.log()


def _correct(off_policy: bool = False, **settings):
    return correction_weights(
        PROXIMAL, BEHAVIOUR, MASK, RolloutCorrectionConfig(**settings), off_policy=off_policy
    )


def _close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-6, rtol=1e-6)


def test_token_level_truncation_by_hand():
    c = _correct(rollout_is="token", rollout_is_threshold=2.0)
    _close(c.weights * MASK, [[2.0, 0.25, 0.0], [1.0, 1.5, 1.0]])
    assert c.mask.tolist() == MASK.tolist()  # truncation drops nothing
    m = c.metrics
    assert m["rollout_is_mean"] == pytest.approx((3 + 0.25 + 1 + 1.5 + 1) / 5)
    assert m["rollout_is_max"] == pytest.approx(3.0)  # the padded 7 does not count
    assert m["rollout_is_truncated_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_rs_masked_fraction"] == 0.0
    k3 = [r - math.log(r) - 1 for r in (3, 0.25, 1, 1.5, 1)]  # exp(log r) - log r - 1
    assert m["kl_behaviour_proximal"] == pytest.approx(sum(k3) / 5, rel=1e-5)


def test_sequence_level_truncation_by_hand():
    # sequence ratios: 3 x 0.25 = 0.75 and 1 x 1.5 x 1 = 1.5
    c = _correct(rollout_is="sequence", rollout_is_threshold=1.2)
    _close(c.weights, [[0.75] * 3, [1.2] * 3])
    m = c.metrics
    assert m["rollout_is_mean"] == pytest.approx((0.75 + 1.5) / 2)  # over sequences
    assert m["rollout_is_max"] == pytest.approx(1.5)
    assert m["rollout_is_truncated_fraction"] == pytest.approx(1 / 2)


def test_token_level_masking_by_hand():
    c = _correct(rollout_is=None, rollout_rs="token", rollout_rs_threshold=2.0)
    assert c.mask.tolist() == [[0, 0, 0], [1, 1, 1]]  # 3 > 2 and 0.25 < 1/2 leave the loss
    assert torch.equal(c.weights, torch.ones_like(c.weights))  # no truncation asked for
    assert c.metrics["rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert c.metrics["rollout_is_truncated_fraction"] == 0.0


def test_sequence_level_masking_by_hand():
    kept = _correct(rollout_is=None, rollout_rs="sequence", rollout_rs_threshold=2.0)
    assert kept.mask.tolist() == MASK.tolist()  # 0.75 and 1.5 lie in [0.5, 2]
    tight = _correct(
        rollout_is=None,
        rollout_rs="sequence",
        rollout_rs_threshold=1.25,
        rollout_rs_threshold_lower=0.8,
    )
    assert tight.mask.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert tight.metrics["rollout_rs_masked_fraction"] == 1.0
    upper_only = _correct(rollout_is=None, rollout_rs="sequence", rollout_rs_threshold=1.4)
    assert upper_only.mask.tolist() == [[1, 1, 0], [0, 0, 0]]  # kept: [1 / 1.4, 1.4]


def test_auto_truncates_per_token_in_off_policy_modes_only():
    async_ = _correct(off_policy=True)
    _close(async_.weights * MASK, [[2.0, 0.25, 0.0], [1.0, 1.5, 1.0]])
    colocated = _correct(off_policy=False)
    assert torch.equal(colocated.weights, torch.ones_like(colocated.weights))
    # ... while the metrics still show the mismatch
    assert colocated.metrics["rollout_is_max"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "settings",
    [
        {"rollout_is": None},
        {"rollout_is": "token", "rollout_is_threshold": 1.0},
        {"rollout_is": "sequence"},
        {"rollout_rs": "token", "rollout_rs_threshold": 1.0},
        {"rollout_rs": "sequence", "rollout_is": "sequence", "rollout_rs_threshold": 1.0},
    ],
)
@pytest.mark.parametrize(
    "loss",
    [
        {},
        {"clip_ratio_high": 0.28, "clip_ratio_c": 3.0},  # clip-higher, dual clip
        {"loss_mode": "gspo", "loss_agg": "seq-mean-token-mean"},
        {"loss_agg": "seq-mean-token-sum-norm"},
    ],
    ids=["vanilla", "clip-higher-dual-clip", "gspo", "seq-mean-token-sum-norm"],
)
def test_behaviour_equal_to_proximal_leaves_loss_and_gradient_exactly_unchanged(settings, loss):
    """The correction's weights multiply every loss mode's per-token term before the
    aggregation (and rejection removes tokens from the mask and the counts): with
    behaviour = proximal each weight is exactly 1 and nothing changes, bit for bit."""
    torch.manual_seed(0)
    behaviour = -torch.rand(4, 5) * 3
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 0.25, -2.0])
    c = correction_weights(
        behaviour, behaviour, mask, RolloutCorrectionConfig(**settings), off_policy=True
    )
    assert torch.equal(c.weights, torch.ones_like(c.weights)) and torch.equal(c.mask, mask)
    logits = behaviour + 0.3 * torch.randn(4, 5)

    def loss_and_grad(loss_mask, **correction):
        current = logits.clone().requires_grad_()
        value, clipped = policy_loss(
            current, behaviour, advantages, loss_mask, clip_ratio=0.2, **loss, **correction
        )
        value.backward()
        return value.detach(), current.grad, clipped

    plain = loss_and_grad(mask)
    # as the update passes them (step.py): the weights, and the mask less rejected tokens
    corrected = loss_and_grad(c.mask, weights=c.weights)
    for a, b in zip(plain, corrected, strict=True):
        assert torch.equal(a, b)


def test_rejected_tokens_leave_the_loss_and_its_counts():
    """Token-level rejection (rho = 3 and 0.25 outside [1/2, 2]) takes the first row out of
    the loss as the update passes it: the mask less the rejected tokens, so the token mean
    is over the 3 kept tokens, not the 5 real ones."""
    c = _correct(rollout_is=None, rollout_rs="token", rollout_rs_threshold=2.0)
    advantages = torch.tensor([1.0, -1.0])
    # on-policy (ratio 1): each kept token's term is -A = +1 (the second row)
    loss, _ = policy_loss(
        BEHAVIOUR, BEHAVIOUR, advantages, c.mask, clip_ratio=0.2, weights=c.weights
    )
    assert loss.item() == pytest.approx(1.0)
    unmasked, _ = policy_loss(BEHAVIOUR, BEHAVIOUR, advantages, MASK, clip_ratio=0.2)
    assert unmasked.item() == pytest.approx((-1 - 1 + 1 + 1 + 1) / 5)


def test_weights_scale_each_tokens_loss_term():
    advantages = torch.tensor([1.0, -1.0])
    weights = torch.tensor([[2.0, 0.25, 0.0], [1.0, 1.5, 1.0]])
    # on-policy (ratio 1): each term is -A, times its weight, over the 5 real tokens
    loss, _ = policy_loss(BEHAVIOUR, BEHAVIOUR, advantages, MASK, clip_ratio=0.2, weights=weights)
    assert loss.item() == pytest.approx((-2 - 0.25 + 1 + 1.5 + 1) / 5)


def test_verl_keys_and_refusals():
    config = load_config(
        overrides=[
            "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_is_threshold=3",
            "algorithm.rollout_correction.rollout_rs=token",
        ]
    )
    rc = config.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs) == ("sequence", 3.0, "token")
    assert not rc.bypass_mode and rc.rs_bounds() == (0.5, 2.0)
    bypass = load_config(overrides=["algorithm.rollout_correction.bypass_mode=true"])
    assert bypass.algorithm.rollout_correction.bypass_mode
    off = load_config(overrides=["algorithm.rollout_correction.rollout_is=null"])
    assert off.algorithm.rollout_correction.is_level(off_policy=True) is None
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["algorithm.rollout_correction.rollout_is=geometric"])
    assert str(err.value) == (
        "algorithm.rollout_correction.rollout_is: 'geometric' is not allowed; "
        "use 'token', 'sequence', 'auto' or null"
    )
    with pytest.raises(
        ConfigError, match=r"rollout_is_threshold: 0.5 is not allowed; use a float >= 1"
    ):
        load_config(overrides=["algorithm.rollout_correction.rollout_is_threshold=0.5"])


def test_rejection_is_refused_in_bypass_mode():
    # bypass_mode's proximal log-probs are the behaviour ones: rho = 1, nothing is rejected
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides=[
                "algorithm.rollout_correction.rollout_rs=sequence",
                "algorithm.rollout_correction.bypass_mode=true",
            ]
        )
    assert str(err.value) == (
        "algorithm.rollout_correction.rollout_rs: 'sequence' cannot act with "
        "algorithm.rollout_correction.bypass_mode=true (the behaviour log-probs are the "
        "proximal ones, so every ratio is 1 and nothing is rejected); "
        "set bypass_mode=false or rollout_rs=null"
    )


def test_gap_watch_warns_once_when_truncation_outgrows_the_limit():
    """One warning line, naming the measured KL, the first time the 10-step mean of the
    truncated fraction passes ``warn_truncated_fraction``; none below it, none with null."""
    watch = GapWatch(RolloutCorrectionConfig(warn_truncated_fraction=0.05))
    said = [watch.observe(step, 0.04, 0.01) for step in range(1, 21)]  # at 4%: quiet
    said += [watch.observe(step, 0.20, 0.30) for step in range(21, 31)]
    warnings = [(step, w) for step, w in enumerate(said, 1) if w is not None]
    # the mean of the last 10 passes 5% at step 21: (0.2 + 0.04 * 9) / 10 = 5.6%
    assert [step for step, _ in warnings] == [21]
    assert "at step 21: 5.6% of tokens' importance weights truncated at 2" in warnings[0][1]
    assert "kl_behaviour_proximal 0.0390 per token" in warnings[0][1]
    quiet = GapWatch(RolloutCorrectionConfig(warn_truncated_fraction=None))
    assert all(quiet.observe(step, 1.0, 1.0) is None for step in range(30))
    with pytest.raises(ValueError, match="warn_truncated_fraction: 0 is not allowed"):
        RolloutCorrectionConfig(warn_truncated_fraction=0)
