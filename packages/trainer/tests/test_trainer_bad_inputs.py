"""Bad data and bad rewards (issue 38, item 5): a prompt longer than the model's context or
``data.max_prompt_length``, a reward function returning something other than numbers, and a
per-sample reward's extras kept per sample (dynamic sampling may group by one)."""

from __future__ import annotations

import pytest
import torch

from rlwire.trainer.algorithms.scoring import fill, score
from rlwire.trainer.config.root import ConfigError, load_config
from rlwire.trainer.data.dataset import load_data, load_validation
from rlwire.trainer.data.rewards import Reward, Rewards, load_reward
from rlwire.trainer.errors import RunError
from rlwire.trainer.rollout import Example, Rollout

ALLOWED = "return a number (a float) or a dict with 'score' holding one"
BATCH_ALLOWED = "a batch function returns a list of one number (a float) per response"
FILTER = (
    "or set data.filter_overlong_prompts=true to drop such rows (or data.truncation to cut them)"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from rlwire.trainer.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _jsonl(path, prompts: list[str]):
    path.write_text("".join(f'{{"prompt": "{p}", "answer": "x"}}\n' for p in prompts))
    return path


def _run_error(call) -> str:
    with pytest.raises(RunError) as err:
        call()
    return str(err.value)


def test_a_prompt_over_the_models_context_is_named_with_its_row(tmp_path, tiny_dir):
    # the tiny model: 64 positions, less rollout.max_new_tokens=8, leaves 56 (one per char)
    data = _jsonl(tmp_path / "d.jsonl", ["a:", "b" * 55 + ":", "b" * 56 + ":", "cd:"])
    config = load_config(overrides=[f"data.source={data}"])
    assert _run_error(lambda: load_data(config, tiny_dir)) == (
        f"data.source: {data} line 3: the prompt is 57 tokens, over the 56 the model's context "
        f"leaves (max_position_embeddings of {tiny_dir}: 64, less rollout.max_new_tokens=8); "
        f"shorten it, lower rollout.max_new_tokens, {FILTER}"
    )
    held_out = load_config(overrides=[f"validation.source={data}"])
    assert _run_error(lambda: load_validation(held_out, tiny_dir)).startswith(
        f"validation.source: {data} line 3: the prompt is 57 tokens, over the 56"
    )
    dropped = load_config(
        overrides=[
            f"data.source={data}",
            "data.filter_overlong_prompts=true",
            "rollout.n=2",
            "data.shuffle=false",  # the kept rows in file order
        ]
    )
    prompts = [e.prompt for e in load_data(dropped, tiny_dir)(0)]
    assert prompts == (["a:", "b" * 55 + ":", "cd:"] * 3)[:8]  # the 57-token row dropped
    roomless = load_config(overrides=[f"data.source={data}", "rollout.max_new_tokens=64"])
    assert _run_error(lambda: load_data(roomless, tiny_dir)) == (
        "rollout.max_new_tokens=64 leaves no room for a prompt in the model's context "
        f"(max_position_embeddings of {tiny_dir}: 64); lower it"
    )


def test_a_prompt_over_max_prompt_length_is_named_or_dropped(tmp_path, tiny_dir):
    data = _jsonl(tmp_path / "d.jsonl", ["a:", "bcdefg:", "h:"])
    config = load_config(overrides=[f"data.source={data}", "data.max_prompt_length=5"])
    assert config.data.max_prompt_length == 5  # verl's key is ours
    assert _run_error(lambda: load_data(config, tiny_dir)) == (
        f"data.source: {data} line 2: the prompt is 7 tokens, over data.max_prompt_length=5; "
        f"shorten it, raise data.max_prompt_length, {FILTER}"
    )
    kept = load_config(
        overrides=[
            f"data.source={data}",
            "data.max_prompt_length=5",
            "data.filter_overlong_prompts=true",
            "data.train_batch_size=2",
            "rollout.n=4",
            "data.shuffle=false",  # the kept rows in file order
        ]
    )
    assert [e.prompt for e in load_data(kept, tiny_dir)(0)] == ["a:", "h:"]
    none_left = load_config(
        overrides=[
            f"data.source={data}",
            "data.max_prompt_length=1",
            "data.filter_overlong_prompts=true",
        ]
    )
    assert _run_error(lambda: load_data(none_left, tiny_dir)) == (
        f"data.source: {data}: every prompt is over 1 tokens (data.filter_overlong_prompts "
        "dropped them all)"
    )


def test_verls_prompt_length_keys():
    verl = load_config(
        overrides=[
            "data.max_prompt_length=512",
            "data.filter_overlong_prompts=true",
            "data.truncation=error",
            "data.filter_overlong_prompts_workers=8",
        ]
    )
    assert (verl.data.max_prompt_length, verl.data.filter_overlong_prompts) == (512, True)
    assert load_config(overrides=["data.truncation=left"]).data.truncation == "left"  # cuts
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["data.truncation=start"])
    assert str(err.value) == (
        "data.truncation: 'start' is not allowed; use one of ['error', 'left', 'right', 'middle']"
    )
    with pytest.raises(ConfigError, match=r"^data.max_prompt_length: 0 is not allowed; use an"):
        load_config(overrides=["data.max_prompt_length=0"])


REWARDS = """
def text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"
def none(data_source, solution_str, ground_truth, extra_info=None):
    return None
def listed(data_source, solution_str, ground_truth, extra_info=None):
    return [1.0]
def dict_text(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": "1.0"}
def flag(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str == ground_truth
def batch_text(prompts, responses, answers):
    return ["1.0"] * len(responses)
def batch_none(prompts, responses, answers):
    return [0.0, None]
def batch_nested(prompts, responses, answers):
    return [[1.0], [0.0]]
def batch_one(prompts, responses, answers):
    return 1.0
def batch_short(prompts, responses, answers):
    return [1.0]
def batch_flags(prompts, responses, answers):
    return [r == a for r, a in zip(responses, answers)]
def verl(data_source, solution_str, ground_truth, extra_info=None):
    hit = solution_str == ground_truth
    return {"score": hit + 0.5, "acc": hit, "pred": solution_str, "len": len(solution_str)}
def partial(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "acc": 1.0} if solution_str == ground_truth else {"score": 0.0}
"""

EXAMPLES = [Example("what is 2+2?", "4"), Example("p2", "5")]


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


def _reward(path, name: str) -> Reward:
    return load_reward(load_config(overrides=[f"reward.function={path}:{name}"]))


@pytest.mark.parametrize(
    ("name", "returned", "response", "allowed"),
    [
        ("text", "'1.0' (a str)", 0, ALLOWED),
        ("none", "None (a NoneType)", 0, ALLOWED),
        ("listed", "[1.0] (a list)", 0, ALLOWED),
        ("dict_text", "a dict whose 'score' is '1.0' (a str)", 0, ALLOWED),
        ("batch_text", "'1.0' (a str)", 0, BATCH_ALLOWED),
        ("batch_none", "None (a NoneType)", 1, BATCH_ALLOWED),
        ("batch_nested", "[1.0] (a list)", 0, BATCH_ALLOWED),
    ],
)
def test_a_reward_that_is_not_a_number_is_named(rewards_file, name, returned, response, allowed):
    reward = _reward(rewards_file, name)
    prompt = EXAMPLES[response].prompt
    assert _run_error(lambda: reward(EXAMPLES, ["4", "x"])) == (
        f"reward.function '{rewards_file}:{name}' returned {returned} for response {response} "
        f"(prompt {prompt!r}); {allowed}"
    )


def test_a_batch_reward_of_the_wrong_form_or_count_names_the_function(rewards_file):
    for name, returned in (("batch_one", "1.0 (a float)"), ("batch_short", "(1,) values")):
        assert _run_error(lambda n=name: _reward(rewards_file, n)(EXAMPLES, ["4", "x"])) == (
            f"reward.function '{rewards_file}:{name}' returned {returned} for 2 responses; "
            f"{BATCH_ALLOWED}"
        )


def test_bools_are_numbers(rewards_file):
    for name in ("flag", "batch_flags"):
        rewards, extras = _reward(rewards_file, name)(EXAMPLES, ["4", "x"])
        assert rewards.tolist() == [1.0, 0.0] and extras == {}


def _generated(texts: list[str], prompts: list[str]) -> Rollout:
    """A generated batch of ``texts`` (one token each) with its ``examples``."""
    b = len(texts)
    ones = torch.ones(b, 1, dtype=torch.int64)
    batch = Rollout(ones, ones, ones, ones, torch.zeros(b, 1), texts)
    batch.examples = [Example(prompt=p, answer="4") for p in prompts]
    return batch


def test_a_per_sample_rewards_extras_are_kept_per_sample(rewards_file):
    reward = _reward(rewards_file, "verl")
    rewards, extras = reward(EXAMPLES * 2, ["4", "x", "x", "5"])
    assert rewards.tolist() == [1.5, 0.5, 0.5, 1.5]
    assert sorted(extras) == ["acc", "len"]  # numbers only: "pred" is text
    torch.testing.assert_close(extras["acc"], torch.tensor([1.0, 0.0, 0.0, 1.0]), atol=0, rtol=0)
    torch.testing.assert_close(extras["len"], torch.tensor([1.0, 1.0, 1.0, 1.0]), atol=0, rtol=0)
    scored = score(load_config(), reward, _generated(["4", "yy", "4", "z"], ["a", "a", "b", "b"]))
    assert scored.extra == {"acc": 0.5, "len": 1.25}  # the metrics: batch means, as before
    assert scored.sample_extras["acc"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scored.sample_extras["len"].dtype == torch.float32
    partial = _reward(rewards_file, "partial")
    assert _run_error(lambda: partial(EXAMPLES, ["4", "x"])) == (
        f"reward.function '{rewards_file}:partial' returned no number for 'acc' (response 0 "
        "gave one) for response 1 (prompt 'p2'); an extra must be a number for every "
        "response or for none"
    )


def _filtering(metric: str, groups: int) -> object:
    return load_config(
        overrides=[
            "rollout.n=2",
            f"data.train_batch_size={groups}",
            "algorithm.filter_groups.enable=true",
            f"algorithm.filter_groups.metric={metric}",
        ]
    )


def _acc_reward(data_source, solution_str, ground_truth, extra_info=None):
    """The reward is the length; ``acc`` whether the response starts with ``y``."""
    return {"score": len(solution_str), "acc": solution_str.startswith("y")}


def test_dynamic_sampling_by_a_per_sample_extra_keeps_the_groups_where_it_differs():
    reward = Rewards([Reward(_acc_reward, "test:acc_reward")])

    def first():  # group 0: rewards differ, acc not; 1: acc differs, rewards not; 2: both; 3: none
        texts = ["y", "yy", "y", "n", "nn", "y", "n", "n"]
        return _generated(texts, ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"])

    second = _generated(["n", "y", "y", "y"], ["p4", "p4", "p5", "p5"])
    batch, scored = fill(_filtering("acc", 3), reward, first(), lambda missing: second)
    assert [e.prompt for e in batch.examples] == ["p1", "p1", "p2", "p2", "p4", "p4"]
    assert scored.kept_groups == [1, 2, 4] and scored.filtered_groups == 3
    assert scored.rewards.tolist() == [1.0, 1.0, 2.0, 1.0, 1.0, 1.0]
    assert scored.sample_extras["acc"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    never = lambda missing: pytest.fail("a second batch was generated")  # noqa: E731
    by_reward, scored = fill(_filtering("reward", 2), reward, first(), never)
    assert [e.prompt for e in by_reward.examples] == ["p0", "p0", "p2", "p2"]
    assert scored.kept_groups == [0, 2]


def test_dynamic_sampling_by_an_extra_the_reward_lacks_is_named(rewards_file):
    reward = Rewards([Reward(_acc_reward, "test:acc_reward")])
    batch = _generated(["y", "n"], ["p0", "p0"])
    assert _run_error(lambda: fill(_filtering("hit", 1), reward, batch, None)) == (
        "algorithm.filter_groups.metric='hit': the reward returned no per-sample 'hit' (its "
        "extras: 'acc'); use 'reward' or an extra key the reward function returns in its dict"
    )
    plain = _reward(rewards_file, "batch_flags")  # a batch function: no extras
    assert _run_error(lambda: fill(_filtering("acc", 1), plain, batch, None)) == (
        "algorithm.filter_groups.metric='acc': the reward returned no per-sample 'acc' (its "
        "extras: none); use 'reward' or an extra key the reward function returns in its dict"
    )


def test_filter_groups_metric_accepts_a_name_of_the_rewards_extras():
    config = load_config(overrides=["algorithm.filter_groups.metric=acc"])
    assert config.algorithm.filter_groups.metric == "acc"
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["algorithm.filter_groups.metric='a b'"])
    assert str(err.value) == (
        "algorithm.filter_groups.metric: 'a b' is not allowed; use 'reward' or the name of an "
        "extra the reward function returns (an identifier such as 'acc')"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"prompt": ["a", "b"], "answer": "a"}',
            "'prompt' item 0 is 'a'; chat messages are objects with 'role' and 'content'",
        ),
        (
            '{"prompt": "a:", "answer": null}',
            "'answer' is null; a ground truth is text or a number",
        ),
        (
            '{"prompt": "a:", "answer": ["7"]}',
            "'answer' is a list (['7']); a ground truth is text or a number",
        ),
    ],
)
def test_a_row_that_would_train_on_garbage_is_named(tmp_path, tiny_dir, line, message):
    data = tmp_path / "d.jsonl"
    data.write_text(line + "\n")
    config = load_config(overrides=[f"data.source={data}", "data.train_batch_size=1"])
    assert (
        _run_error(lambda: load_data(config, tiny_dir)) == f"data.source: {data} line 1: {message}"
    )


def test_an_unreadable_or_corrupt_file_is_one_line(tmp_path, tiny_dir, monkeypatch):
    broken = tmp_path / "d.parquet"
    broken.write_bytes(b"not parquet at all")
    config = load_config(overrides=[f"data.source={broken}"])
    assert _run_error(lambda: load_data(config, tiny_dir)).startswith(
        f"data.source: cannot read {broken} as Parquet: "
    )
    locked = tmp_path / "locked.jsonl"
    locked.write_text('{"prompt": "a:", "answer": "a"}\n')
    config = load_config(overrides=[f"data.source={locked}"])

    def refused(self):  # what a file without read permission gives a user who is not root
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(locked), "read_bytes", refused)
    assert _run_error(lambda: load_data(config, tiny_dir)) == (
        f"data.source: cannot read {locked}: Permission denied"
    )
