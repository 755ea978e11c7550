"""Inputs validated before anything starts: model, data, reward."""

from __future__ import annotations

import pytest
import torch

from rlwire.trainer.config import load_config
from rlwire.trainer.errors import RunError
from rlwire.trainer.inputs import load_data, load_reward, resolve_model, score


def test_missing_model_directory(tmp_path):
    config = load_config(overrides=[f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(
        RunError,
        match=r"^model.path: .*nope is not a Hugging Face model "
        r"directory \(no config.json there\)",
    ):
        resolve_model(config, tmp_path)


def test_builtin_data_is_deterministic_per_step():
    batches = load_data(load_config())
    assert batches(3) == batches(3) and batches(3) != batches(4)
    assert len(batches(0)) == 8


def test_jsonl_data_and_a_malformed_line_named(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text('{"prompt": "a:", "answer": "a"}\n\n{"prompt": "b:", "answer": "b"}\n')
    batches = load_data(
        load_config(overrides=[f"data.source={good}", "data.train_batch_size=4", "rollout.n=2"])
    )
    assert batches(0) == [("a:", "a"), ("b:", "b"), ("a:", "a"), ("b:", "b")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a:", "answer": "a"}\n{"prompt": "b:"}\n')
    with pytest.raises(
        RunError,
        match=r"bad.jsonl line 2 is not a JSON object with 'prompt' "
        r"and 'answer'",
    ):
        load_data(load_config(overrides=[f"data.source={bad}"]))


def test_reward_from_file_and_import_errors(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def score(prompts, responses, answers):\n    return [len(r) for r in responses]\n"
        "def broken(prompts, responses, answers):\n    return [1.0]\n"
    )
    fn = load_reward(load_config(overrides=[f"reward.function={f}:score"]))
    assert fn([], ["ab", ""], []) == [2, 0]
    with pytest.raises(RunError, match=r"^reward.function: cannot import 'nowhere.mod:f'"):
        load_reward(load_config(overrides=["reward.function=nowhere.mod:f"]))
    with pytest.raises(RunError, match=r"is not 'builtin', 'module.path:function'"):
        load_reward(load_config(overrides=["reward.function=justaname"]))
    broken = load_reward(load_config(overrides=[f"reward.function={f}:broken"]))
    with pytest.raises(RunError, match=r"returned \(1,\) values for 3 responses"):
        score(broken, ["p"] * 3, ["x"] * 3, ["a"] * 3)
    assert torch.equal(score(fn, ["p"], ["abc"], ["a"]), torch.tensor([3.0]))


def test_parquet_data_and_a_row_missing_a_column_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["a:", "b:"], "answer": ["a", "b"]}), good)
    batches = load_data(
        load_config(
            overrides=[
                f"data.source={good}",
                "data.prompt_key=question",
                "data.train_batch_size=2",
                "rollout.n=4",
            ]
        )
    )
    assert batches(1) == [("a:", "a"), ("b:", "b")]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["a:"], "solution": ["a"]}), bad)
    with pytest.raises(RunError, match=r"bad.parquet row 1 lacks 'question' or 'answer'"):
        load_data(load_config(overrides=[f"data.source={bad}", "data.prompt_key=question"]))
