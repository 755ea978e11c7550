"""The GRPO pieces together, in one process: the built-in task is learnable."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from rlwire.trainer.algorithms.advantages import group_advantages
from rlwire.trainer.algorithms.step import compute_old_logprobs, grpo_update
from rlwire.trainer.models.tiny import build_tiny_model, repeat_prompts, repeat_reward
from rlwire.trainer.rollout import hf_generate

N, PROMPTS = 8, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_rollout_logprobs_match_the_actors_recomputation(tiny):
    model, tokenizer = tiny
    rollout = hf_generate(
        model, tokenizer, ["a:", "bc:"], n=3, max_new_tokens=6, temperature=0.7, seed=0
    )
    assert rollout.response_ids.shape == (6, 6) and len(rollout.texts) == 6
    old = compute_old_logprobs(model, rollout, micro_batch_size=4, temperature=0.7)
    torch.testing.assert_close(old, rollout.logprobs, atol=1e-5, rtol=0)


def test_grpo_raises_the_reward_of_the_builtin_task(tiny):
    model, tokenizer = tiny
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rewards = []
    for step in range(40):
        data = repeat_prompts(PROMPTS, seed=step)
        answers = [a for _, a in data for _ in range(N)]
        rollout = hf_generate(
            model,
            tokenizer,
            [p for p, _ in data],
            n=N,
            max_new_tokens=8,
            temperature=1.0,
            seed=step,
        )
        reward = torch.tensor(repeat_reward([], rollout.texts, answers))
        old = compute_old_logprobs(model, rollout, micro_batch_size=32, temperature=1.0)
        metrics = grpo_update(
            model,
            optimizer,
            rollout,
            old,
            group_advantages(reward, N),
            micro_batch_size=16,
            temperature=1.0,
            clip_ratio=0.2,
        )
        rewards.append(reward.mean().item())
    assert metrics["grad_sync_policy"] == "defer" and metrics["retained_grad_bytes"] == 0
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # A random policy scores about 1/26 per token; learning must be unmistakable.
    assert first < 0.1 and last > first + 0.15, (first, last)


def test_kl_to_the_reference_is_zero_at_the_start_and_enters_the_loss(tiny):

    model, tokenizer = tiny
    policy = copy.deepcopy(model)
    rollout = hf_generate(
        policy, tokenizer, ["a:"] * 2, n=2, max_new_tokens=4, temperature=1.0, seed=1
    )
    old = compute_old_logprobs(policy, rollout, micro_batch_size=4, temperature=1.0)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    update = functools.partial(
        grpo_update,
        policy,
        opt,
        rollout,
        old,
        adv,
        micro_batch_size=4,
        temperature=1.0,
        clip_ratio=0.2,
        kl_coef=0.1,
    )
    m = update(ref_logprobs=old)
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # same weights as the reference
    shifted = update(ref_logprobs=old - 0.5)
    assert shifted["kl_ref"] == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-5)  # r = -0.5


def test_partial_generation_keeps_each_tokens_behaviour_logprob_across_a_weight_change(tiny):
    """Responses stopped after 3 tokens and continued by other weights: the first tokens
    keep the first weights' log-probs, the continuation has the second weights'."""
    from rlwire.trainer.rollout import hf_extend, hf_start

    model, tokenizer = tiny
    newer = copy.deepcopy(model)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = hf_start(tokenizer, ["a:", "bcd:"], n=3)
    assert rows.response_ids.shape == (6, 0) and rows.prompt_ids.shape[0] == 6
    first, ended = hf_extend(model, tokenizer, rows, max_new_tokens=3, temperature=0.8, seed=4)
    going = (~ended).nonzero().flatten()
    assert len(going) > 0 and first.response_mask[going].all()
    rest = first.select(going)
    grown, _ = hf_extend(newer, tokenizer, rest, max_new_tokens=4, temperature=0.8, seed=5)
    assert torch.equal(grown.response_ids[:, :3], rest.response_ids)  # the start is kept
    assert torch.equal(grown.logprobs[:, :3], rest.logprobs)
    mask = grown.response_mask
    under_old = compute_old_logprobs(model, grown, micro_batch_size=8, temperature=0.8)
    under_new = compute_old_logprobs(newer, grown, micro_batch_size=8, temperature=0.8)
    torch.testing.assert_close(grown.logprobs[:, :3], under_old[:, :3], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        grown.logprobs[:, 3:] * mask[:, 3:], under_new[:, 3:], atol=1e-5, rtol=0
    )
    assert (grown.logprobs[:, 3:] - under_old[:, 3:]).abs().max() > 1e-3  # the weights differ


def _update_setup(tiny):
    model, tokenizer = tiny
    rollout = hf_generate(
        model, tokenizer, ["a:", "b:"], n=4, max_new_tokens=5, temperature=1.0, seed=3
    )
    old = compute_old_logprobs(model, rollout, micro_batch_size=8, temperature=1.0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 2.0, -2.0])
    return model, rollout, old, advantages


def test_one_mini_batch_and_one_epoch_is_exactly_todays_step(tiny):
    from rlwire.trainer.algorithms.step import ppo_update

    model, rollout, old, advantages = _update_setup(tiny)
    results = []
    for split in (False, True):
        policy = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        update = functools.partial(
            grpo_update, policy, optimizer, micro_batch_size=4, temperature=1.0, clip_ratio=0.2
        )
        if split:
            metrics = ppo_update(
                rollout, old, mini_batch_size=8, epochs=1, update=update, advantages=advantages
            )
            assert metrics["optimizer_steps"] == 1
        else:
            metrics = update(rollout=rollout, old_logprobs=old, advantages=advantages)
        results.append((metrics["policy_loss"], [p.detach().clone() for p in policy.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


def test_two_mini_batches_take_two_steps_and_the_second_is_clipped_against_the_first(tiny):
    from rlwire.trainer.algorithms.step import ppo_update

    model, rollout, old, advantages = _update_setup(tiny)
    policy = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=5e-2)
    steps = []

    def optimizer_step() -> float:
        steps.append(sum(p.grad.abs().sum().item() for p in policy.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return 0.0

    update = functools.partial(
        grpo_update,
        policy,
        None,
        micro_batch_size=4,
        temperature=1.0,
        clip_ratio=0.2,
        optimizer_step=optimizer_step,
    )
    metrics = ppo_update(
        rollout, old, mini_batch_size=4, epochs=2, update=update, advantages=advantages
    )
    assert metrics["optimizer_steps"] == 4 and len(steps) == 4  # 2 mini-batches x 2 epochs
    assert all(s > 0 for s in steps)
    # after the first steps the policy has moved away from the proximal one: the ratio
    # leaves [0.8, 1.2] for some tokens in the second epoch, and the clip acts
    assert metrics["clip_fraction"] > 0


def test_on_policy_update_reuses_the_training_forward_bit_for_bit(tiny):
    """Exactly on-policy, the proximal log-probs are the training forward's own: skipping the
    separate forward pass changes nothing, losses, clip fraction and gradients bit for bit."""
    from rlwire.trainer.config.root import load_config

    model, tokenizer = tiny
    rollout = hf_generate(
        model, tokenizer, ["a:", "bc:", "d:"], n=4, max_new_tokens=6, temperature=1.0, seed=3
    )
    advantages = group_advantages(torch.arange(12, dtype=torch.float32) % 3, 4)
    runs = []
    for separate in (True, False):
        policy = copy.deepcopy(model)
        grads = {}

        def capture(policy=policy, grads=grads) -> float:
            grads.update({n: p.grad.clone() for n, p in policy.named_parameters()})
            return 0.0

        old = compute_old_logprobs(policy, rollout, micro_batch_size=5, temperature=1.0)
        recorded = torch.full_like(rollout.logprobs, float("nan"))
        metrics = grpo_update(
            policy,
            None,
            rollout,
            old if separate else None,
            advantages,
            micro_batch_size=5,  # 3 micro-batches, the last one short
            temperature=1.0,
            clip_ratio=0.2,
            optimizer_step=capture,
            record=None if separate else recorded,
        )
        runs.append((metrics, grads))
        if not separate:  # what it recorded is what the forward pass would have returned
            assert torch.equal(recorded, old)
    (with_pass, grads_with), (without, grads_without) = runs
    for key in ("policy_loss", "clip_fraction", "entropy"):
        assert with_pass[key] == without[key], key
    assert grads_with.keys() == grads_without.keys()
    for name, grad in grads_with.items():
        assert torch.equal(grad, grads_without[name]), name
    # The trainer skips the pass exactly where the update is on-policy.
    assert load_config().reuses_training_logprobs()
    for override in (
        "trainer.mode=fully_async",
        "actor.ppo_epochs=2",
        "actor.ppo_mini_batch_size=4",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token",
        "algorithm.rollout_correction.bypass_mode=true",
    ):
        assert not load_config(overrides=[override]).reuses_training_logprobs(), override
