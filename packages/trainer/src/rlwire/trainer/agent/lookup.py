"""The built-in multi-turn task ``lookup`` (``data.source=builtin:lookup``): the prompt is a
key of three letters (``cab``), the answer is the three digits the tool :func:`lookup`
returns for it (a hash of the key: nothing in the prompt or the model's weights tells it).
The model must call the tool in the Hermes format, read the result and answer with it.

Its model is the built-in tiny Qwen2 with the tokens the task needs (role tokens, the
tool-call and tool-response tags, and the fixed parts of the call's JSON as two tokens)
and a chat template. A randomly initialised model cannot find a JSON tool call by sampling,
nor (measured) learn by RL alone to read a tool's result, so it is primed before RL, as an
instruct model knows its tool syntax: on conversations that all call the tool with the
prompt's key and answer with its result, until the greedy model does both on held-out
keys; then briefly, at a tenth of the learning rate, on conversations of which only one in
ten calls the tool and the others answer three random digits. It starts knowing how to
call and read but calling in a few percent of its first turns, near chance (a digit in ten
right): RL has to learn to call the tool.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from ..models.tiny import LETTERS, build_tiny_model, build_tokenizer
from ..rollout.common import Example

__all__ = [
    "CHAT_TEMPLATE",
    "build_lookup_model",
    "build_lookup_tokenizer",
    "lookup",
    "lookup_examples",
    "lookup_reward",
]

KEY_LENGTH = 3
CODE_LENGTH = 3
PRIMING_CHECK_EVERY = 50
PRIMING_MAX_STEPS = 3000
SKILLED = 0.9
"""Priming on conversations that all call the tool runs until the greedy model writes the
key and answers with the code on this share of held-out keys (checked every
``PRIMING_CHECK_EVERY`` steps, at most ``PRIMING_MAX_STEPS``)."""
SHY_STEPS = 100
SHY_CALL_SHARE = 0.1
SHY_LR = 3e-4
"""Then ``SHY_STEPS`` steps at learning rate ``SHY_LR`` on conversations of which this
share calls the tool."""
_ROLES = ["<|user|>", "<|assistant|>", "<|tool|>"]
CALL_HEAD = '{"name": "lookup", "arguments": {"key": "'
CALL_TAIL = '"}}'
_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_HEAD, CALL_TAIL]

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>{{ m.content }}<eos>"
    "{%- elif m.role == 'assistant' -%}<|assistant|>{{ m.content }}<eos>"
    "{%- elif m.role == 'tool' -%}<|tool|><tool_response>{{ m.content }}</tool_response><eos>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""User, assistant and tool turns each end with ``<eos>`` (where generation stops); tools
are not listed in the prompt (the tiny model knows its one tool from priming)."""


def lookup(key: str) -> str:
    """Look up the code stored under a key.

    Args:
        key: three letters from a to j, as given in the prompt.
    """
    if len(key) != KEY_LENGTH or any(c not in LETTERS for c in key):
        raise ValueError(f"no entry {key!r}: keys are {KEY_LENGTH} letters from a to j")
    digest = hashlib.sha256(key.encode()).digest()
    return "".join(str(b % 10) for b in digest[:CODE_LENGTH])


def lookup_examples(count: int, *, seed: int) -> list[tuple[str, str]]:
    """``count`` ``(key, code)`` pairs, deterministic in ``seed``."""
    rng = random.Random(seed)
    keys = ["".join(rng.choice(LETTERS) for _ in range(KEY_LENGTH)) for _ in range(count)]
    return [(key, lookup(key)) for key in keys]


def lookup_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """Partial credit on the final answer (the text after the last ``</tool_response>``,
    spaces ignored): the share of positions where it and the code agree, over the longer of
    the two (1 for exactly the code; a random answer of three digits scores 0.1 on average)."""
    rewards = []
    for response, answer in zip(responses, answers, strict=True):
        final = response.rpartition("</tool_response>")[2].replace(" ", "")
        right = sum(a == b for a, b in zip(final, answer, strict=False))
        rewards.append(right / max(len(final), len(answer)))
    return rewards


def as_example(prompt: str, answer: str, source: str) -> Example:
    """A lookup row: the key as the user's message."""
    return Example(
        prompt=prompt,
        answer=answer,
        data_source=source,
        messages=[{"role": "user", "content": prompt}],
    )


def build_lookup_tokenizer():
    """The tiny character-level tokenizer with the task's tokens and chat template."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": _ROLES})
    tokenizer.add_tokens(_TAGS)  # not special: they stay in decoded text, as Qwen's do
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _primer(rng: random.Random, call_share: float) -> list[tuple[str, bool]]:
    """One priming conversation: its pieces of text, each with whether the loss counts it
    (the assistant's)."""
    key = "".join(rng.choice(LETTERS) for _ in range(KEY_LENGTH))
    pieces = [(f"<|user|>{key}<eos><|assistant|>", False)]
    if rng.random() < call_share:
        pieces.append((f"<tool_call>{CALL_HEAD}{key}{CALL_TAIL}</tool_call><eos>", True))
        pieces.append(
            (f"<|tool|><tool_response>{lookup(key)}</tool_response><eos><|assistant|>", False)
        )
        answer = lookup(key)
    else:
        answer = "".join(str(rng.randrange(10)) for _ in range(CODE_LENGTH))
    pieces.append((answer + "<eos>", True))
    return pieces


def _encode(
    tokenizer, conversations: list[list[tuple[str, bool]]]
) -> list[tuple[list[int], list[int]]]:
    """Each conversation's tokens and loss mask. Every piece is tokenized alone (as the
    chat template's turns are), all in one batch call: a call per piece took the tokenizer
    longer than the training steps took."""
    texts = [text for pieces in conversations for text, _ in pieces]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"])
    out = []
    for pieces in conversations:
        ids: list[int] = []
        mask: list[int] = []
        for _, trained in pieces:
            part = next(encoded)
            ids.extend(part)
            mask.extend([int(trained)] * len(part))
        out.append((ids, mask))
    return out


def _skill(model, tokenizer, keys: list[str]) -> tuple[float, float]:
    """The share of ``keys`` for which the greedy model writes the call's key right, and the
    share for which it answers with the tool's code (each given what precedes it)."""
    import torch

    def greedy(prefixes: list[str], count: int) -> list[str]:
        ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes])
        with torch.no_grad():
            for _ in range(count):
                step = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, step], dim=1)
        return [tokenizer.decode(row[-count:]) for row in ids.tolist()]

    opening = [f"<|user|>{k}<eos><|assistant|><tool_call>{CALL_HEAD}" for k in keys]
    called = [
        f"{o}{k}{CALL_TAIL}</tool_call><eos><|tool|><tool_response>{lookup(k)}"
        "</tool_response><eos><|assistant|>"
        for o, k in zip(opening, keys, strict=True)
    ]
    written = greedy(opening, KEY_LENGTH)
    answered = greedy(called, CODE_LENGTH)
    return (
        sum(w == k for w, k in zip(written, keys, strict=True)) / len(keys),
        sum(a == lookup(k) for a, k in zip(answered, keys, strict=True)) / len(keys),
    )


def build_lookup_model(
    directory: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2
) -> Path:
    """Create (once) the lookup task's tiny model and tokenizer in ``directory``, primed
    (see the module's docstring); return it."""
    rng = random.Random(seed)
    held_out = [e for e, _ in lookup_examples(32, seed=seed + 1)]

    def prime(model, tokenizer) -> None:
        import torch

        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

        def train(steps: int, share: float) -> None:
            for _ in range(steps):
                rows = _encode(tokenizer, [_primer(rng, share) for _ in range(128)])
                width = max(len(ids) for ids, _ in rows)
                pad = tokenizer.pad_token_id
                ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in rows])
                mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows])
                loss = model(input_ids=ids, labels=ids.masked_fill(mask == 0, -100)).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        done = 0
        while done < PRIMING_MAX_STEPS and min(_skill(model, tokenizer, held_out)) < SKILLED:
            train(PRIMING_CHECK_EVERY, 1.0)
            done += PRIMING_CHECK_EVERY
        if min(_skill(model, tokenizer, held_out)) < SKILLED:
            raise RuntimeError(
                f"the lookup model (seed {seed}) did not learn to call and read the tool in "
                f"{PRIMING_MAX_STEPS} priming steps; try another trainer.seed"
            )
        for group in optimizer.param_groups:  # gently: the decision, not the skills
            group["lr"] = SHY_LR
        train(SHY_STEPS, SHY_CALL_SHARE)

    return build_tiny_model(
        directory,
        seed=seed,
        hidden=hidden,
        layers=layers,
        tokenizer=build_lookup_tokenizer(),
        train=prime,
    )
