"""The embedded job's locally built model, tokenizer and task."""

from __future__ import annotations

import pytest
import torch

from rlwire.trainer.tiny import VOCAB, build_tiny_model, repeat_prompts, repeat_reward


def test_tiny_model_is_a_real_hugging_face_directory(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "tiny")
    assert build_tiny_model(path) == path  # cached: built once
    from transformers import PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(VOCAB)
    # However transformers reads the directory, the ids are the same.
    auto = AutoTokenizer.from_pretrained(path)
    fast = PreTrainedTokenizerFast.from_pretrained(path)
    ids = fast("c:")["input_ids"]
    assert auto("c:")["input_ids"] == ids == [VOCAB.index("c"), VOCAB.index(":")]
    assert auto.decode([VOCAB.index("a")] * 3).replace(" ", "") == "aaa"
    assert fast.decode([VOCAB.index("a")] * 3).replace(" ", "") == "aaa"
    tokenizer = auto
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=4, do_sample=True, pad_token_id=tokenizer.pad_token_id
    )
    assert out.shape == (1, 6)


def test_prompts_are_deterministic_and_reward_gives_partial_credit():
    assert repeat_prompts(3, seed=1) == repeat_prompts(3, seed=1)
    prompt, answer = repeat_prompts(1, seed=0)[0]
    assert prompt == f"{answer}:"
    assert repeat_reward(["p"] * 4, ["cccc", "c a c a", "", "ab;;"], ["c", "c", "c", "a"]) == [
        1.0,
        0.5,
        0.0,
        0.25,
    ]
    with pytest.raises(ValueError):
        repeat_reward(["p"], ["c", "c"], ["c"])
