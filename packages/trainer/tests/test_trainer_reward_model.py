"""A reward model (a sequence-classification model) scores completions as a direct
transformers forward does, beside function rewards with their weights, named by TRL's
reward_funcs, by reward.model or by verl's reward_model.model.path."""

from __future__ import annotations

import pytest
import torch

from rlwire.trainer.config.root import load_config
from rlwire.trainer.data.rewards import load_reward
from rlwire.trainer.errors import RunError
from rlwire.trainer.rollout import Example


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny one-label sequence classifier with the tiny model's tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from rlwire.trainer.models.tiny import build_tiny_model

    tiny = build_tiny_model(tmp_path_factory.mktemp("base") / "tiny")
    config = AutoConfig.from_pretrained(tiny, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    folder = tmp_path_factory.mktemp("rm") / "letter-rm"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _direct(folder, texts: list[str]) -> list[float]:
    """Each text's score by a plain transformers forward, one text at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            out.append(float(model(**ids).logits[0, 0]))
    return out


def test_a_reward_model_scores_as_a_direct_forward_beside_functions(reward_model_dir):
    examples = [Example(prompt=p, answer="") for p in ("a:", "bb:", "c:")]
    texts = ["a", "bbbb", "zz"]
    want = _direct(reward_model_dir, [e.prompt + t for e, t in zip(examples, texts, strict=True)])
    config = load_config(
        overrides=[f"reward.model={reward_model_dir}", "reward.model_batch_size=2"]
    )
    rewards = load_reward(config)
    assert [r.name for r in rewards.rewards] == ["letter-rm"] and not rewards.needs_answer()
    values, _ = rewards(examples, texts)  # padded batches of 2: the same scores
    assert torch.allclose(values, torch.tensor(want), atol=1e-5, rtol=0)

    def length(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    both = load_config(  # as GRPOTrainer names its callables: one weight each, then the model
        overrides=[
            "reward.function=here:length",
            f"reward.model={reward_model_dir}",
            "reward.weights=[0.5,2.0]",
        ]
    )
    values, extras = load_reward(both, [length])(examples, texts)
    expected = [0.5 * len(t) + 2.0 * w for t, w in zip(texts, want, strict=True)]
    assert torch.allclose(values, torch.tensor(expected), atol=1e-5, rtol=0)
    assert torch.allclose(extras["letter-rm"], torch.tensor(want), atol=1e-5, rtol=0)
    # TRL's reward_funcs naming the model, and verl's key
    assert load_reward(load_config(), [str(reward_model_dir)]).rewards[0].name == "letter-rm"
    verl = load_config(
        overrides=["reward_model.enable=true", f"reward_model.model.path={reward_model_dir}"]
    )
    assert verl.reward.model == str(reward_model_dir)


def test_a_model_without_weights_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(RunError, match=r"^reward model .*: cannot be loaded as a scorer: "):
        load_reward(load_config(overrides=[f"reward.model={tmp_path}"]))
