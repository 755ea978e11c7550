"""The GRPO pieces together, in one process: the built-in task is learnable."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from rlwire.trainer.grpo import group_advantages
from rlwire.trainer.rollout import hf_generate
from rlwire.trainer.step import compute_old_logprobs, grpo_update
from rlwire.trainer.tiny import build_tiny_model, repeat_prompts, repeat_reward

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
