"""Advantage estimators, loss aggregation over a split mini-batch, and the policy losses, by
hand (verl's own functions: test_trainer_verl.py, in the verl environment)."""

from __future__ import annotations

import math

import pytest
import torch

from rlwire.trainer.algorithms.advantages import LOSS_AGG_MODES, AlgorithmConfig, compute_advantages
from rlwire.trainer.algorithms.losses import LossScale, aggregate, policy_loss
from rlwire.trainer.config.root import ConfigError, load_config


def _mask(lengths: list[int], width: int = 4) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).float()


def _advantages(estimator: str, rewards: list[float], n: int, lengths: list[int]) -> torch.Tensor:
    config = AlgorithmConfig(adv_estimator=estimator)
    return compute_advantages(config, torch.tensor(rewards), _mask(lengths), n)


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    adv = _advantages("rloo", [1.0, 0.0, 0.0, 3.0, 3.0, 0.0], 3, [1] * 6)
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, 1.5, 1.5, -3.0]))


def test_reinforce_plus_plus_whitens_over_tokens():
    # tokens: one of reward 1, three of reward 0: mean 0.25, unbiased variance 0.25
    adv = _advantages("reinforce_plus_plus", [1.0, 0.0], 1, [1, 3])
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5]) * (0.5 / math.sqrt(0.25 + 1e-8)))


def test_reinforce_plus_plus_baseline_centres_in_the_group_then_whitens():
    adv = _advantages("reinforce_plus_plus_baseline", [1.0, 0.0, 2.0, 2.0], 2, [1, 3, 2, 2])
    # centred [0.5, -0.5, 0, 0]; token mean -1/8; unbiased variance 0.125
    expected = torch.tensor([0.625, -0.375, 0.125, 0.125]) / math.sqrt(0.125 + 1e-8)
    torch.testing.assert_close(adv, expected)


def test_grpo_with_groups_of_one_keeps_the_reward_as_verl_does():
    adv = _advantages("grpo", [1.0, 0.0], 1, [2, 2])
    torch.testing.assert_close(adv, torch.tensor([1.0 / (1 + 1e-6), 0.0]))


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 9.0, 9.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = _mask([3, 1, 0])  # the last sequence has no counted token: not counted
    got = {mode: aggregate(values, mask, mode).item() for mode in LOSS_AGG_MODES}
    assert got == pytest.approx(
        {
            "token-mean": (6 + 4) / 4,
            "seq-mean-token-sum": (6 + 4) / 2,
            "seq-mean-token-mean": (2 + 4) / 2,
            "seq-mean-token-sum-norm": (6 + 4) / 2 / 4,  # the horizon: the mask's width
        }
    )
    with pytest.raises(ValueError, match="loss_agg: 'mean' is not allowed; use 'token-mean'"):
        aggregate(values, mask, "mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_mini_batch_split_over_micro_batches_and_ranks_aggregates_as_a_whole(mode):
    """Each part's share, summed over micro-batches (gradient accumulation) and averaged
    over ranks (data parallelism), is the whole mini-batch's aggregate: the gradient does
    not depend on the split, nor on how rejection sampling thinned a micro-batch."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    mask = _mask([6, 1, 0, 3, 6, 2, 5, 4], width=6).double()
    whole = aggregate(values, mask, mode, LossScale.of(mask, horizon=6))
    scale = LossScale.of(mask, world=2, horizon=6)  # the counts over both ranks
    ranks = [slice(0, 4), slice(4, 8)]
    micro = [[slice(0, 1), slice(1, 4)], [slice(0, 3), slice(3, 4)]]  # uneven on purpose
    per_rank = [
        sum(aggregate(values[r][m], mask[r][m], mode, scale) for m in parts)
        for r, parts in zip(ranks, micro, strict=True)
    ]
    torch.testing.assert_close(sum(per_rank) / 2, whole)


def _loss(log_ratio: list[float], advantage: float, **kwargs) -> torch.Tensor:
    logprobs = torch.tensor([log_ratio])
    return policy_loss(
        logprobs,
        torch.zeros_like(logprobs),
        torch.tensor([advantage]),
        torch.ones_like(logprobs),
        clip_ratio=0.2,
        **kwargs,
    )[0]


def test_clip_higher_and_the_dual_clip():
    ratio = math.log(1.25)
    assert _loss([ratio], 1.0).item() == pytest.approx(-1.2)  # clipped at 1 + 0.2
    assert _loss([ratio], 1.0, clip_ratio_high=0.28).item() == pytest.approx(-1.25)
    # a negative advantage and a ratio of e^2: PPO's max(...) lets it grow with the ratio;
    # the dual clip bounds it at -A x c
    assert _loss([2.0], -1.0).item() == pytest.approx(math.exp(2.0))
    assert _loss([2.0], -1.0, clip_ratio_c=3.0).item() == pytest.approx(3.0)
    assert _loss([2.0], 1.0, clip_ratio_c=3.0).item() == pytest.approx(-1.2)  # A > 0: no effect


def test_gspo_clips_the_sequence_ratio_and_its_gradient_is_the_sequences():
    # log-ratios 0.1 and 0.3: the sequence's is their mean 0.2, e^0.2 = 1.221 > 1.2: clipped
    assert _loss([0.1, 0.3], 1.0, loss_mode="gspo").item() == pytest.approx(-1.2)
    logprobs = torch.tensor([[0.05, -0.05]], requires_grad=True)
    loss, _ = policy_loss(
        logprobs,
        torch.zeros(1, 2),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        clip_ratio=0.2,
        loss_mode="gspo",
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)  # the sequence's ratio is exactly 1
    # d/d logp_t of -A x s, s = sg[s] p_t / sg[p_t]: -s per token, token-mean over 2
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5]]))


def test_new_keys_and_their_verl_spellings():
    config = load_config(
        overrides=[
            "algorithm.adv_estimator=rloo",
            "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.clip_ratio_c=10.0",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor_rollout_ref.actor.entropy_coeff=0.001",
            "algorithm.gamma=1.0",
        ]
    )
    a = config.algorithm
    assert (a.adv_estimator, a.clip_low, a.clip_high, a.clip_ratio_c) == ("rloo", 0.2, 0.28, 10.0)
    assert (a.loss_mode, a.loss_agg, a.entropy_coeff) == ("gspo", "seq-mean-token-sum-norm", 0.001)
    with pytest.raises(ConfigError, match=r"^algorithm.clip_ratio_c: 1.0 is not allowed; use"):
        load_config(overrides=["algorithm.clip_ratio_c=1.0"])
    with pytest.raises(ConfigError, match=r"^algorithm.loss_mode: 'dppo_tv' is not allowed"):
        load_config(overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv"])


def test_overlong_buffer_penalises_the_last_tokens_linearly():
    from rlwire.trainer.algorithms.shaping import OverlongBufferConfig, overlong_penalty

    config = OverlongBufferConfig(enable=True, len=8, penalty_factor=1.0)
    # max 32 tokens, the last 8 penalised: from 0 at 24 tokens to -1 at 32
    penalty = overlong_penalty(torch.tensor([20, 24, 28, 32]), 32, config)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    with pytest.raises(ConfigError, match=r"^reward.overlong_buffer.len: 64 is not allowed; use"):
        load_config(
            overrides=["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=64"]
        )
    verl = load_config(
        overrides=[
            "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
            "reward.reward_kwargs.overlong_buffer_cfg.len=4",
            "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "reward_model.overlong_buffer.log=false",
        ]
    )
    assert verl.reward.overlong_buffer == OverlongBufferConfig(
        enable=True, len=4, penalty_factor=0.5
    )


def _generated(texts: list[str], prompts: list[str]):
    """A generated batch of ``texts`` (one token each) with its ``examples``."""
    from rlwire.trainer.rollout import Example, Rollout

    b = len(texts)
    ones = torch.ones(b, 1, dtype=torch.int64)
    batch = Rollout(ones, ones, ones, ones, torch.zeros(b, 1), texts)
    batch.examples = [Example(prompt=p, answer="") for p in prompts]
    return batch


def test_dynamic_sampling_keeps_groups_that_differ_and_generates_until_full():
    from rlwire.trainer.algorithms.scoring import fill
    from rlwire.trainer.errors import RunError

    config = load_config(
        overrides=["rollout.n=2", "data.train_batch_size=3", "algorithm.filter_groups.enable=true"]
    )

    def reward(examples, texts, ids):  # what the driver's reward gives: the length
        return torch.tensor([float(len(t)) for t in texts]), {}

    # 3 groups of 2: only the second differs; then 3 more, of which 2 differ; then 3 more
    batches = iter(
        [
            _generated(["a", "a", "a", "bb", "c", "c"], ["p0", "p0", "p1", "p1", "p2", "p2"]),
            _generated(["d", "dd", "e", "e", "f", "ff"], ["p3", "p3", "p4", "p4", "p5", "p5"]),
        ]
    )
    first = next(batches)
    batch, scored = fill(config, reward, first, lambda missing: next(batches))
    assert [e.prompt for e in batch.examples] == ["p1", "p1", "p3", "p3", "p5", "p5"]
    assert scored.rewards.tolist() == [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    assert (scored.gen_batches, scored.filtered_groups) == (2, 3)
    assert scored.kept_groups == [1, 3, 5]  # of the 6 groups seen
    limited = load_config(
        overrides=[
            "rollout.n=2",
            "data.train_batch_size=3",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=1",
        ]
    )
    again = _generated(["a", "a", "a", "bb", "c", "c"], ["p0", "p0", "p1", "p1", "p2", "p2"])
    with pytest.raises(RunError) as err:
        fill(limited, reward, again, lambda missing: pytest.fail("a second batch was generated"))
    assert str(err.value) == (
        "algorithm.filter_groups: 1 generation batches gave 1 of 3 prompt groups whose rewards "
        "differ (max_num_gen_batches=1); raise it, or 0 for no limit"
    )


class _SleepingEngine:
    """A rollout worker whose calls run in the order made (as a Ray actor's do) and whose
    engine, like vLLM's after ``sleep(level=1)``, cannot generate while asleep."""

    def __init__(self) -> None:
        self.asleep, self.calls = False, []

    def _call(self, name, run):
        outer = self

        class Method:
            def remote(self, *args):
                outer.calls.append(name)
                return run(*args)

        return Method()

    def __getattr__(self, name):
        if name == "generate":

            def generate(examples, seed):
                if self.asleep:
                    raise RuntimeError("generation on a sleeping engine")
                return _generated(["x"] * len(examples) * 2, [e.prompt for e in examples] * 2)

            return self._call(name, generate)
        if name in ("sleep", "wake_up"):
            return self._call(name, lambda: setattr(self, "asleep", name == "sleep"))
        raise AttributeError(name)


def test_dynamic_sampling_wakes_sleeping_engines_before_each_extra_batch():
    """Colocated on GPUs the engines sleep after every generation; an extra batch of dynamic
    sampling (``generate_more``) must wake them first (vLLM crashes otherwise)."""
    import types

    from rlwire.trainer.rollout import Example
    from rlwire.trainer.runtime.job import Job

    config = load_config(overrides=["rollout.n=2", "data.train_batch_size=2"])
    engines = [_SleepingEngine(), _SleepingEngine()]
    job = types.SimpleNamespace(
        config=config,
        rollouts=engines,
        rollout_sleeps=True,
        extra_batches=0,
        data=types.SimpleNamespace(  # the job's DataPipeline: only its batches are read
            batches=lambda position: [Example(prompt=f"p{position}", answer="")] * 2
        ),
        call=lambda refs, what: list(refs),
        fleet=types.SimpleNamespace(heals=False, present=[0, 1], assign=lambda n: list(range(n))),
    )
    job.healed = types.MethodType(Job.healed, job)
    job.start_generation = types.MethodType(Job.start_generation, job)
    job.generate_more = types.MethodType(Job.generate_more, job)
    job.start_generation(0)()
    assert all(e.asleep for e in engines)
    job.generate_more(0)
    more = job.generate_more(0)
    assert job.extra_batches == 2 and len(more) == 2 * 2  # 2 prompts x rollout.n
    for e in engines:
        assert e.calls == ["generate", "sleep"] + ["wake_up", "generate", "sleep"] * 2


@pytest.mark.parametrize(
    "mode", ["colocated", pytest.param("one_step_off", marks=pytest.mark.floor), "fully_async"]
)
def test_dapos_recipe_runs_end_to_end_through_verls_keys(mode, ray_cluster, tmp_path):
    """Clip-higher, dynamic sampling, token-mean and overlong shaping, set with verl's keys,
    in every mode: about half the prompts score 0 on every sample, the others by their
    text; groups are filtered on the reward's ``acc`` (the score before the overlong
    penalty, which makes even an all-zero group's rewards differ by length), as verl's DAPO
    recipe does, so the all-zero groups are dropped and more are generated, or taken from
    the queue."""
    import json

    from trainer_cli import train_cli

    reward = tmp_path / "reward.py"
    reward.write_text(
        "def reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    odd = sum(map(ord, ground_truth)) % 2\n"
        "    score = 0.0 if odd else sum(map(ord, solution_str)) % 7 / 7\n"
        "    return {'score': score, 'acc': score}\n"
    )
    run = tmp_path / "run"
    records, _ = train_cli(
        run,
        f"trainer.mode={mode}",
        "trainer.steps=3",
        f"custom_reward_function.path={reward}",
        "custom_reward_function.name=reward",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=20",
        "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
        "reward.reward_kwargs.overlong_buffer_cfg.len=4",
        "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "validation.source=builtin:repeat",  # fully async: through the sample queue
        "validation.every=2",
        cluster=ray_cluster,
    )
    held_out = [r for r in records if "reward_mean" not in r]
    records = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in held_out] == [2, 3]  # every 2nd update, and the last
    assert all(0.0 <= r["val/reward_mean"] <= 1.0 for r in held_out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert sum(r["filtered_groups"] for r in records) > 0
    assert all(r["gen_batches"] >= 1 and r["reward_std"] > 0 for r in records)
    assert all(r["samples_per_s"] > 0 for r in records)
    assert all(-1.0 <= r["reward_extra/overlong_penalty"] <= 0.0 for r in records)
    state = json.loads((run / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    if mode == "fully_async":  # the groups trained, none twice; the queue keeps the rest
        trained = [i for r in records for i in r["group_indices"]]
        assert len(trained) == len(set(trained)) == 8 * 3
    else:  # the data position moved on by the extra batches: a resume goes on from there
        assert state["extra_batches"] == sum(r["gen_batches"] - 1 for r in records)


def test_validation_keys_and_where_it_runs():
    config = load_config(
        overrides=[
            "data.val_files=[held_out.jsonl]",
            "trainer.test_freq=-1",  # verl's never
            "trainer.val_before_train=true",
            "actor_rollout_ref.rollout.val_kwargs.n=4",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            "actor_rollout_ref.rollout.val_kwargs.top_p=1.0",
        ]
    )
    v = config.validation
    assert (v.source, v.every, v.before_train, v.n, v.temperature) == (
        "held_out.jsonl",
        0,
        True,
        4,
        0.7,
    )
    assert v.sampling.greedy is False
    with pytest.raises(ConfigError, match=r"val_kwargs.top_p: 0.9 is not allowed"):
        load_config(overrides=["actor_rollout_ref.rollout.val_kwargs.top_p=0.9"])


def test_kl_in_reward_by_hand():
    from rlwire.trainer.algorithms.reward_kl import KLControlConfig, KLController, kl_estimate

    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_estimate(logprobs, ref, "kl"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_estimate(logprobs, ref, "mse"), torch.tensor([[0.125, 0.5]]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(kl_estimate(logprobs, ref, "low_var_kl"), torch.tensor([k3]))
    # adaptive: 1 + clip(kl / target - 1, -0.2, 0.2) x n / horizon
    beta = KLController(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=100))
    beta.update(0.15, 50)  # +50% clipped to +20%, x 50/100
    assert beta.value == pytest.approx(0.1 * 1.1)
    fixed = KLController(KLControlConfig(kl_coef=0.1))
    fixed.update(5.0, 50)
    assert fixed.value == 0.1
    with pytest.raises(ConfigError, match=r"^algorithm.use_kl_in_reward: True is not allowed"):
        load_config(
            overrides=[
                "algorithm.use_kl_in_reward=true",
                "algorithm.adv_estimator=reinforce_plus_plus",
            ]
        )
