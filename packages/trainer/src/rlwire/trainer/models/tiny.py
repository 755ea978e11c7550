"""The embedded default job's model, tokenizer and task, all built locally (no downloads).

- A character-level tokenizer over a fixed vocabulary (special tokens, the
  letters ``a``-``j``, the digits, ``:`` and ``;``), wrapped as a
  ``PreTrainedTokenizerFast``. Character level on purpose: transformers 5's
  ``AutoTokenizer`` loads a ``qwen2`` directory as ``Qwen2Tokenizer`` (byte-level
  BPE rebuilt from the vocabulary), which splits unmerged text into characters;
  with a character vocabulary and no spaces both readings give the same ids.
- A tiny Qwen2-architecture causal LM with random weights, saved with
  ``save_pretrained`` next to the tokenizer so that every engine (and the user)
  loads it like any Hugging Face directory.
- The ``repeat`` task: the prompt names a letter (``c:``) and the
  policy should answer with that letter again and again. The reward gives
  partial credit: the fraction of response tokens equal to the letter. A
  random model scores about 1/len(vocab); GRPO lifts that within minutes on
  a CPU, which makes learning visible without any pretraining.
- The ``count`` task (the ``realistic`` preset's): the prompt names a letter and a
  count (``c3:``) and the answer is the letter that many times, then the end of the
  sequence. Counts follow a long-tailed law (1 + a geometric variable, mean 4, one in
  25 is 12 or more), so response lengths vary as a reasoning task's do; the reward is
  the share of positions right, over the longer of answer and response, so both the
  letter and where to stop count.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "LETTERS",
    "build_tiny_model",
    "build_tokenizer",
    "count_prompts",
    "count_reward",
    "repeat_prompts",
    "repeat_reward",
]

LETTERS = list("abcdefghij")
_SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
VOCAB = _SPECIAL + LETTERS + [str(d) for d in range(10)] + [":", ";"]


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over :data:`VOCAB`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


TINY_MARK = "rlwire_tiny"
"""A key of the built-in tiny models' ``config.json`` (true): a run of such a folder keeps
the sections' defaults, which are the toy's, instead of a real model's
(:data:`rlwire.trainer.config.root.REAL_MODEL_DEFAULTS`). A copy saved by transformers keeps
it."""


def build_tiny_model(
    directory: str | Path,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    tokenizer=None,
    train: Callable[[Any, Any], None] | None = None,
) -> Path:
    """Create (once) a tiny Qwen2 model and its tokenizer in ``directory``; return it.

    ``tokenizer``: another than :func:`build_tokenizer`'s (the model's vocabulary is its);
    ``train(model, tokenizer)``: run on the fresh model before it is saved (a task's
    priming). An existing directory with a ``config.json`` is reused as is.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        # head size 32: the smallest vLLM's CPU attention takes (it rejects 16)
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    setattr(config, TINY_MARK, True)  # a run of it keeps the toy's defaults (config.root)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if train is not None:
        train(model, tokenizer)
    tmp = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(directory)  # complete or absent: a killed build is rebuilt next time
    return directory


def repeat_prompts(count: int, *, seed: int) -> list[tuple[str, str]]:
    """``count`` ``(prompt, answer)`` pairs of the repeat task, deterministic in ``seed``."""
    rng = random.Random(seed)
    letters = [rng.choice(LETTERS) for _ in range(count)]
    return [(f"{c}:", c) for c in letters]


def repeat_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """Partial credit: the fraction of response characters equal to the answer letter.

    Spaces are ignored (decoders differ in how they join characters); an empty
    response scores 0.
    """
    rewards = []
    for response, answer in zip(responses, answers, strict=True):
        chars = response.replace(" ", "")
        rewards.append(sum(ch == answer for ch in chars) / len(chars) if chars else 0.0)
    return rewards


_COUNT_STOP = 0.25  # the geometric law's chance to stop at each further count
_COUNT_MAX = 24


def count_prompts(count: int, *, seed: int) -> list[tuple[str, str]]:
    """``count`` ``(prompt, answer)`` pairs of the count task (``"c3:"``, ``"ccc"``),
    deterministic in ``seed``: counts are 1 + a geometric variable (mean 4), at most 24."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        letter, times = rng.choice(LETTERS), 1
        while times < _COUNT_MAX and rng.random() > _COUNT_STOP:
            times += 1
        pairs.append((f"{letter}{times}:", letter * times))
    return pairs


def count_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """The share of positions where response and answer agree, over the longer of the two:
    1 for exactly the answer, less for a wrong letter, a missing one or one too many (spaces
    ignored; an empty response scores 0)."""
    rewards = []
    for response, answer in zip(responses, answers, strict=True):
        chars = response.replace(" ", "")
        right = sum(a == b for a, b in zip(chars, answer, strict=False))
        rewards.append(right / max(len(chars), len(answer)) if chars else 0.0)
    return rewards
