"""Token-budget micro-batches (verl's ``use_dynamic_bsz``) and the padding-free forward
(verl's ``use_remove_padding``): the partition, and the same losses, gradients and
log-probs as the padded fixed-row path.

Tolerances (fp32 on the CPU): losses ``rel=1e-5``, gradients and log-probs ``rtol=1e-4,
atol=1e-5``. Trimming and packing change the shapes of the matmuls, so results are not
bit-exact; the largest differences measured here are 5e-8 on losses of order 1 and 5e-7 on
gradients and log-probs, 20x or more inside the tolerances, while a wrong mask, position or
row order moves them by 1e-2 or more.
"""

from __future__ import annotations

import datetime
import random
import tempfile
import time
import types

import pytest
import torch

from rlwire.trainer.algorithms import micro_batches
from rlwire.trainer.algorithms.micro_batches import (
    balanced_partition,
    micro_batch_count,
    rank_shares,
    row_tokens,
    split_rows,
    token_budget_partition,
)
from rlwire.trainer.algorithms.step import compute_old_logprobs, grpo_update
from rlwire.trainer.config.root import ConfigError, load_config
from rlwire.trainer.models.tiny import build_tiny_model
from rlwire.trainer.rollout import Rollout

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
BUDGET = 30  # below the longest row (32 tokens): that row gets a micro-batch of its own
PATHS = {
    "token budget": {"max_tokens": BUDGET},
    "token budget, packed": {"max_tokens": BUDGET, "remove_padding": True},
    "fixed rows, packed": {"remove_padding": True},
}


def _rollout(seed: int = 0, rows: int = 12, prompt: int = 7, response: int = 25) -> Rollout:
    """Rows of very different lengths: prompts of 1 to ``prompt`` tokens (left-padded),
    responses of 1 to ``response`` (right-padded); row 0 the longest, row 1 the shortest."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, prompt + 1, (rows,), generator=g)
    r_len = torch.randint(1, response + 1, (rows,), generator=g)
    p_len[0], r_len[0], p_len[1], r_len[1] = prompt, response, 1, 1
    p_mask = (torch.arange(prompt) >= prompt - p_len[:, None]).long()
    r_mask = (torch.arange(response) < r_len[:, None]).long()
    p_ids = torch.randint(4, 26, (rows, prompt), generator=g) * p_mask
    r_ids = torch.randint(4, 26, (rows, response), generator=g) * r_mask
    return Rollout(p_ids, p_mask, r_ids, r_mask, torch.zeros(rows, response), [""] * rows)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=request.param)


# --- the partition ---------------------------------------------------------------------------


def _check_groups(groups, lengths, budget):
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # each row once
    for g in groups:
        assert len(g) == 1 or sum(lengths[i] for i in g) <= budget, (g, budget)


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_within_the_budget_and_a_longer_row_alone(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(40)] + [75]  # the last row over the budget
    groups = token_budget_partition(lengths, 70)
    _check_groups(groups, lengths, 70)
    assert [40] in groups
    assert len(groups) == micro_batch_count(lengths, 70) >= -(-sum(lengths) // 70)


def test_told_a_larger_count_it_gives_that_many_within_the_budget():
    lengths = [32, 3, 5, 9, 21, 26, 11, 13, 8, 20, 4, 6]
    fewest = micro_batch_count(lengths, BUDGET)
    assert fewest == 6 == -(-sum(lengths) // BUDGET)  # the least any split could give
    for count in range(fewest, len(lengths) + 1):
        groups = token_budget_partition(lengths, BUDGET, count=count)
        assert len(groups) == count
        _check_groups(groups, lengths, BUDGET)


def test_a_larger_count_that_breaks_the_budget_splits_the_fewest_groups(monkeypatch):
    lengths = [10, 9, 8, 7, 6, 5]
    real = micro_batches.balanced_partition

    def unbalanced(values, parts):  # every row but the last parts - 1 in one group
        if parts != 4:
            return real(values, parts)
        return [list(range(len(values) - parts + 1))] + [
            [i] for i in range(len(values) - parts + 1, len(values))
        ]

    monkeypatch.setattr(micro_batches, "balanced_partition", unbalanced)
    groups = token_budget_partition(lengths, 20, count=4)
    assert len(groups) == 4
    _check_groups(groups, lengths, 20)


def test_balanced_by_token_count():
    assert [len(g) for g in balanced_partition([5] * 8, 4)] == [2, 2, 2, 2]
    assert balanced_partition([10] + [1] * 10, 2) == [[0], list(range(1, 11))]
    lengths = [9, 8, 7, 6, 5, 4, 3, 2]  # 44 tokens: 11 a group is the best
    sums = [sum(lengths[i] for i in g) for g in balanced_partition(lengths, 4)]
    assert max(sums) - min(sums) <= 1, sums
    assert balanced_partition([3, 1, 2], 3) == [[0], [1], [2]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_shares_are_equal_in_size_and_near_equal_in_tokens(seed):
    """``trainer.balance_batch``: every rank the same number of rows, every row once, the
    token sums within the longest row of each other; on a long-tailed batch far closer than
    consecutive shares."""
    rng = random.Random(seed)
    lengths = sorted((rng.choice([8, 9, 10, 120]) for _ in range(64)), reverse=True)
    shares = rank_shares(lengths, 4)
    assert [len(s) for s in shares] == [16] * 4
    assert sorted(i for s in shares for i in s) == list(range(64))
    sums = [sum(lengths[i] for i in s) for s in shares]
    consecutive = [sum(lengths[r * 16 : (r + 1) * 16]) for r in range(4)]
    assert max(sums) - min(sums) <= max(lengths)
    assert max(sums) - min(sums) < (max(consecutive) - min(consecutive)) / 4
    with pytest.raises(ValueError, match="rank_shares: 6 rows do not split over 4 ranks"):
        rank_shares([1] * 6, 4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: token_budget_partition([1, 2], 0),
            "max_tokens: 0 is not allowed; use an int >= 1",
        ),
        (lambda: micro_batch_count([1, 2], -3), "max_tokens: -3 is not allowed; use an int >= 1"),
        (
            lambda: token_budget_partition([5, 5, 5], 10, count=1),
            "count: 1 is not allowed; use 2 (the fewest micro-batches within 10 tokens) to 3",
        ),
        (
            lambda: token_budget_partition([5, 5, 5], 10, count=4),
            "count: 4 is not allowed; use 2 (the fewest micro-batches within 10 tokens) to 3",
        ),
        (lambda: balanced_partition([1, 2], 0), "parts: 0 is not allowed; use 1 to 2 (the rows)"),
    ],
)
def test_bad_partition_arguments_raise_one_clear_error(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value).startswith(message)


def test_split_rows_fixed_rows_are_consecutive_slices():
    r = _rollout()
    assert split_rows(r.prompt_mask, r.response_mask, rows=5, max_tokens=None) == [
        slice(0, 5),
        slice(5, 10),
        slice(10, 12),
    ]


def test_split_rows_token_budget_gives_row_indices_out_of_order():
    r = _rollout()
    lengths = row_tokens(r.prompt_mask, r.response_mask)
    assert lengths == [32, 2, 5, 5, 9, 22, 27, 13, 7, 26, 20, 6]
    parts = split_rows(r.prompt_mask, r.response_mask, rows=4, max_tokens=BUDGET)
    groups = [p.tolist() for p in parts]
    _check_groups(groups, lengths, BUDGET)
    # not consecutive rows: the tests below check results come back in row order
    assert any(g != list(range(g[0], g[0] + len(g))) for g in groups), groups


# --- the configuration -----------------------------------------------------------------------


def test_defaults_keep_fixed_rows_and_the_padded_forward():
    actor = load_config().actor
    assert (actor.use_dynamic_bsz, actor.use_remove_padding) == (False, False)
    assert actor.update_token_budget() is None and actor.log_prob_token_budget() is None
    assert actor.ppo_max_token_len_per_gpu == 16384


def test_verl_keys_set_the_budgets_and_the_packed_forward():
    actor = load_config(
        overrides=[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "actor_rollout_ref.model.use_remove_padding=true",
        ]
    ).actor
    assert actor.update_token_budget() == 4096 and actor.log_prob_token_budget() == 4096
    assert actor.use_remove_padding
    actor = load_config(
        overrides=[
            "actor.use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
        ]
    ).actor
    assert actor.update_token_budget() == 16384 and actor.log_prob_token_budget() == 8192
    actor = load_config(overrides=["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"]).actor
    assert actor.update_token_budget() is None and actor.log_prob_token_budget() == 16384


def test_verl_spellings_of_one_key_must_agree():
    """verl's rollout and ref budgets are one key here: set alike they load, set apart they
    are refused naming both (rather than the last one winning)."""
    both = "actor_rollout_ref.{}.log_prob_max_token_len_per_gpu={}"
    alike = [both.format("rollout", 8192), both.format("ref", 8192)]
    assert load_config(overrides=alike).actor.log_prob_max_token_len_per_gpu == 8192
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref\.rollout\.log_prob_max_token_len_per_gpu=8192 and "
        r"actor_rollout_ref\.ref\.log_prob_max_token_len_per_gpu=4096 both set "
        r"actor\.log_prob_max_token_len_per_gpu; give one value",
    ):
        load_config(overrides=[both.format("rollout", 8192), both.format("ref", 4096)])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor.ppo_max_token_len_per_gpu=0",
            "actor.ppo_max_token_len_per_gpu: 0 is not allowed; use an int >= 1",
        ),
        (
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=-1",
            "actor.ppo_max_token_len_per_gpu: -1 is not allowed; use an int >= 1",
        ),
        (
            "actor.log_prob_max_token_len_per_gpu=0",
            "actor.log_prob_max_token_len_per_gpu: 0 is not allowed; use an int >= 1 or null",
        ),
    ],
)
def test_a_bad_budget_raises_one_clear_error(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert str(err.value) == message


# --- the same results as the padded fixed-row path --------------------------------------------


def test_old_logprobs_match_the_padded_path_in_row_order(model):
    r = _rollout()
    padded = compute_old_logprobs(model, r, micro_batch_size=4, temperature=0.7)
    assert bool((padded != 0).sum() == r.response_mask.sum())  # every real token scored
    for kwargs in PATHS.values():
        other = compute_old_logprobs(model, r, micro_batch_size=4, temperature=0.7, **kwargs)
        torch.testing.assert_close(other, padded, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_loss_and_gradients_match_the_padded_path(model, loss_agg):
    r = _rollout()
    g = torch.Generator().manual_seed(1)
    ref = compute_old_logprobs(model, r, micro_batch_size=4, temperature=0.7)
    old = (ref + 0.1 * torch.randn(ref.shape, generator=g)) * r.response_mask  # the clip acts
    advantages = torch.randn(len(r), generator=g)

    def update(**kwargs):
        model.zero_grad(set_to_none=True)
        record = torch.zeros_like(ref)
        metrics = grpo_update(
            model,
            None,
            r,
            None if kwargs.pop("on_policy", False) else old,
            advantages,
            micro_batch_size=4,
            temperature=0.7,
            clip_ratio=0.2,
            loss_agg=loss_agg,
            entropy_coeff=0.01,
            ref_logprobs=ref,
            kl_coef=0.1,
            optimizer_step=lambda: 0.0,  # keep the gradients to compare
            record=record,
            **kwargs,
        )
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return metrics, grads, record

    padded, padded_grads, _ = update()
    assert padded["clip_fraction"] > 0
    for label, kwargs in PATHS.items():
        metrics, grads, _ = update(**kwargs)
        assert metrics["policy_loss"] == pytest.approx(padded["policy_loss"], rel=1e-5), label
        assert metrics["kl_ref"] == pytest.approx(padded["kl_ref"], rel=1e-5, abs=1e-9), label
        for name, grad in grads.items():
            torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-5)
    # on-policy: the recorded log-probs are each micro-batch's own, put back in row order
    _, _, recorded = update(on_policy=True, max_tokens=BUDGET, remove_padding=True)
    torch.testing.assert_close(recorded, ref, rtol=1e-4, atol=1e-5)


def test_padding_shrinks(model):
    """Each token-budget micro-batch is as wide as its own longest prompt and response; a
    packed one is one row of its real tokens."""
    r = _rollout()
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        groups = split_rows(r.prompt_mask, r.response_mask, rows=4, max_tokens=BUDGET)
        compute_old_logprobs(model, r, micro_batch_size=4, temperature=1.0, max_tokens=BUDGET)
        p_len, r_len = r.prompt_mask.sum(1), r.response_mask.sum(1)
        assert shapes == [(len(g), int(p_len[g].max() + r_len[g].max())) for g in groups]
        shapes.clear()
        compute_old_logprobs(
            model, r, micro_batch_size=4, temperature=1.0, max_tokens=BUDGET, remove_padding=True
        )
        assert shapes == [(1, int(p_len[g].sum() + r_len[g].sum())) for g in groups]
    finally:
        hook.remove()


def test_an_attention_that_cannot_pack_is_refused():
    class Stub(torch.nn.Module):
        config = types.SimpleNamespace(_attn_implementation="my_kernel")

    with pytest.raises(ValueError) as err:
        compute_old_logprobs(
            Stub(), _rollout(), micro_batch_size=4, temperature=1.0, remove_padding=True
        )
    assert str(err.value).startswith(
        "actor.use_remove_padding: the model's attention implementation 'my_kernel' does not "
        "keep packed sequences apart; load the model with one of 'sdpa', 'eager'"
    )


def test_a_packed_row_without_a_prompt_token_is_refused(model):
    r = _rollout()
    r.prompt_mask[3] = 0
    with pytest.raises(ValueError) as err:
        compute_old_logprobs(model, r, micro_batch_size=4, temperature=1.0, remove_padding=True)
    assert str(err.value) == (
        "row 3 of a micro-batch has no prompt token: its first response token has no context"
    )


# --- every rank runs as many micro-batches --------------------------------------------------


def _count_on_rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(  # met through a file in ``out``: no port to pick
        "gloo",
        init_method=f"file://{out}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    r = _rollout(seed=rank, response=25 if rank == 0 else 3)  # rank 1: short responses
    parts = split_rows(r.prompt_mask, r.response_mask, rows=4, max_tokens=BUDGET)
    groups = [p.tolist() for p in parts]
    torch.save((groups, row_tokens(r.prompt_mask, r.response_mask)), f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_every_rank_runs_the_most_micro_batches_any_rank_needs():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _count_on_rank,
            args=(2, out),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 120
        try:
            while not context.join(timeout=0.5):
                assert time.monotonic() < deadline, "the two gloo ranks did not finish in 120 s"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = [torch.load(f"{out}/{rank}.pt") for rank in range(2)]
    (long_groups, long_lengths), (short_groups, short_lengths) = results
    own = micro_batch_count(long_lengths, BUDGET), micro_batch_count(short_lengths, BUDGET)
    assert own[0] > own[1]  # without agreeing, rank 1 would run fewer
    assert len(long_groups) == len(short_groups) == own[0]
    _check_groups(long_groups, long_lengths, BUDGET)
    _check_groups(short_groups, short_lengths, BUDGET)
