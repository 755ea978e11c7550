"""The one batch type (``Rollout``): concatenation, groups, shards, devices."""

from __future__ import annotations

import dataclasses

import torch

from rlwire.trainer.rollout import Example, Rollout


def _part(rows: int, width_p: int, width_r: int, version: int, start: int) -> Rollout:
    ids = torch.arange(start, start + rows * width_p).reshape(rows, width_p)
    resp = torch.arange(start, start + rows * width_r).reshape(rows, width_r) + 1000
    return Rollout(
        ids,
        torch.ones_like(ids),
        resp,
        torch.ones_like(resp),
        torch.full((rows, width_r), -0.5),
        [f"t{start + i}" for i in range(rows)],
        pad_id=7,
        versions=torch.full((rows, width_r), version),
        examples=[Example(f"p{start + i}", f"a{start + i}") for i in range(rows)],
    )


def test_concat_pads_prompts_left_and_responses_right_and_keeps_everything_in_order():
    a, b = _part(2, 3, 2, version=4, start=0), _part(2, 1, 4, version=5, start=100)
    batch = Rollout.concat([a, b])
    assert len(batch) == 4 and batch.pad_id == 7
    assert batch.prompt_ids[2].tolist() == [7, 7, 100] and batch.prompt_mask[2].tolist() == [
        0,
        0,
        1,
    ]
    assert batch.response_ids[0].tolist() == [1000, 1001, 7, 7]
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0]
    assert batch.logprobs[0].tolist() == [-0.5, -0.5, 0.0, 0.0]
    assert batch.versions[0].tolist() == [4, 4, 0, 0]  # per token, padded like the responses
    assert batch.sample_versions().tolist() == [4, 4, 5, 5] and batch.version == 4
    assert batch.version_spans().tolist() == [0, 0, 0, 0]
    assert batch.texts == ["t0", "t1", "t100", "t101"]
    assert [e.prompt for e in batch.examples] == ["p0", "p1", "p100", "p101"]
    assert batch.examples[3].answer == "a101"
    assert batch.rewards is None  # not every part was scored


def test_groups_shards_and_device_moves_keep_rows_together():
    batch = Rollout.concat([_part(4, 2, 3, version=1, start=0)])
    batch.rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    first, second = batch.groups(2)
    assert first.texts == ["t0", "t1"] and [e.prompt for e in second.examples] == ["p2", "p3"]
    assert second.rewards.tolist() == [0.5, 0.25]
    shard = batch.shard(1, 2)
    assert shard.advantages.tolist() == [0.5, -0.5]
    torch.testing.assert_close(shard.response_ids, batch.response_ids[2:], atol=0, rtol=0)
    assert Rollout.concat([first, second]).advantages.tolist() == batch.advantages.tolist()
    moved = batch.to("meta")
    assert moved.advantages.device.type == "meta" and moved.texts == batch.texts
    try:
        batch.groups(3)
    except ValueError as err:
        assert str(err) == "4 samples do not split into groups of 3"
    else:
        raise AssertionError("4 samples split into groups of 3")


def test_a_sample_continued_across_a_sync_has_the_version_of_its_oldest_token():
    batch = _part(3, 2, 4, version=0, start=0)
    batch.versions = torch.tensor([[3, 3, 4, 4], [4, 4, 4, 9], [2, 4, 4, 5]])
    batch.response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    # row 1's last position is padding: its version (9) counts for nothing
    assert batch.sample_versions().tolist() == [3, 4, 2] and batch.version == 2
    assert batch.version_spans().tolist() == [1, 0, 3]
    picked = batch.select(torch.tensor([2, 0]))
    assert picked.texts == ["t2", "t0"] and [e.prompt for e in picked.examples] == ["p2", "p0"]
    assert picked.version_spans().tolist() == [3, 1]


def test_a_batch_travels_as_numpy_arrays_and_comes_back_equal_and_writable():
    """Between processes the tensors are numpy arrays (raw buffers to Ray); read-only
    buffers (how Ray hands them back) are copied so the tensors stay writable."""
    import pickle

    import numpy

    batch = Rollout.concat(
        [_part(2, 3, 2, version=4, start=0), _part(2, 1, 4, version=5, start=100)]
    )
    batch.rewards = torch.tensor([0.0, 1.0, 0.5, 0.25])
    reduce, (values,) = batch.__reduce__()
    assert isinstance(values["prompt_ids"], numpy.ndarray) and values["advantages"] is None
    for value in values.values():
        if isinstance(value, numpy.ndarray):
            value.flags.writeable = False
    back = reduce(values)
    again = pickle.loads(pickle.dumps(batch))
    for copy in (back, again):
        for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
            assert torch.equal(getattr(copy, field), getattr(batch, field))
        assert torch.equal(copy.logprobs, batch.logprobs) and copy.logprobs.dtype == torch.float32
        assert torch.equal(copy.versions, batch.versions) and torch.equal(
            copy.rewards, batch.rewards
        )
        assert copy.advantages is None and copy.texts == batch.texts and copy.pad_id == 7
        assert copy.examples == batch.examples
    back.prompt_ids[0, 0] = -1  # writable, and its own memory
    assert batch.prompt_ids[0, 0] != -1
    bf16 = dataclasses.replace(batch, logprobs=batch.logprobs.bfloat16())  # no numpy dtype
    assert torch.equal(pickle.loads(pickle.dumps(bf16)).logprobs, bf16.logprobs)
