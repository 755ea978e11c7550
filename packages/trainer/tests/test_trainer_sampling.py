"""The ``hf`` engine samples from the distribution the actor recomputes, whatever the model
directory's ``generation_config.json`` and tokenizer defaults say."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlwire.trainer.algorithms.step import compute_old_logprobs
from rlwire.trainer.config.root import load_config
from rlwire.trainer.models.tiny import build_tiny_model
from rlwire.trainer.rollout import HFEngine

TEMPERATURE = 0.7
PROMPTS = ["a:", "bcd:", "ee:"]
# What a released model's generation_config.json may carry; merged into ``generate``'s
# settings, each entry changes the distribution it samples from.
PENALTIES = {
    "do_sample": True,
    "repetition_penalty": 1.5,
    "top_k": 5,
    "min_p": 0.2,
    "no_repeat_ngram_size": 2,
    "bad_words_ids": [[4]],
}


def _engine(path, n: int) -> HFEngine:
    config = load_config(
        overrides=[
            f"rollout.n={n}",
            "rollout.max_new_tokens=12",
            f"rollout.temperature={TEMPERATURE}",
        ]
    )
    return HFEngine(config, str(path), torch.device("cpu"))


@pytest.fixture(scope="module")
def plain_and_penalised(tmp_path_factory):
    """The tiny model twice: as built, and with ``PENALTIES`` in its generation config."""
    plain = build_tiny_model(tmp_path_factory.mktemp("model") / "plain")
    penalised = shutil.copytree(plain, plain.with_name("penalised"))
    file = penalised / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **PENALTIES}))
    return plain, penalised


def test_the_engine_samples_from_the_plain_distribution_the_actor_recomputes(
    plain_and_penalised,
):
    plain, penalised = plain_and_penalised
    engine = _engine(penalised, n=8)
    assert engine.model.generation_config.repetition_penalty == 1.5  # the file is read
    out = engine.generate(PROMPTS, seed=0)
    mask = out.response_mask.bool()
    recomputed = compute_old_logprobs(
        engine.model, out, micro_batch_size=8, temperature=TEMPERATURE
    )
    torch.testing.assert_close(out.logprobs[mask], recomputed[mask], atol=1e-5, rtol=0)
    # ... and those are the sampler's: same seed, same samples as without the penalties
    reference = _engine(plain, n=8).generate(PROMPTS, seed=0)
    assert torch.equal(out.response_ids, reference.response_ids)
    assert torch.equal(out.logprobs, reference.logprobs)
    # which the penalties would have forbidden: a bigram repeated within a response
    repeated = 0
    for row, real in zip(out.response_ids, mask, strict=True):
        tokens = row[real].tolist()
        bigrams = list(zip(tokens, tokens[1:], strict=False))
        repeated += len(bigrams) - len(set(bigrams))
    assert repeated > 0
    assert engine.model.generation_config.repetition_penalty == 1.5  # left as it was


def test_prompts_are_left_padded_whatever_the_tokenizers_default(tmp_path):
    from transformers import AutoTokenizer

    path = build_tiny_model(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(path)
    engine = _engine(path, n=2)
    assert engine.tokenizer.padding_side == "right"  # the saved default is kept
    ids = {c: engine.tokenizer.convert_tokens_to_ids(c) for c in "abcd:"}
    pad = engine.tokenizer.pad_token_id
    short, long = [pad, pad, ids["a"], ids[":"]], [ids[c] for c in "bcd:"]
    expected_ids = torch.tensor([short] * 2 + [long] * 2)
    expected_mask = torch.tensor([[0, 0, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2)
    for rows in (engine.start(["a:", "bcd:"]), engine.generate(["a:", "bcd:"], seed=0)):
        assert torch.equal(rows.prompt_ids, expected_ids)
        assert torch.equal(rows.prompt_mask, expected_mask)
