"""The built-in multi-turn task ``lookup`` (``data.source=builtin:lookup``): the prompt is a
key of three letters (``cab``), the answer is the three digits the tool :func:`lookup`
returns for it. The code is drawn at random for each data row and reaches the tool from the
row (``extra_info.tools_kwargs.lookup.create_kwargs.table``, verl's key), so nothing in the
prompt or the model's weights tells it: only reading the tool's result does. The model must
call the tool in the Hermes format, read the result and answer with it.

Its model is the built-in tiny Qwen2, 96 wide (three heads) and two layers deep (64 wide,
copying a code it has never seen took priming 1,800 steps to begin on seed 1 with two
layers, and 1,100 on seed 0 with three; 96 wide, 200-600 steps on seeds 0-3), the tokens the
task needs (role tokens, the tool-call and tool-response tags, and the fixed parts of the
call's JSON as two tokens) and a chat template. A randomly initialised model cannot find a
JSON tool call by sampling, nor (measured) learn by RL alone to read a tool's result, so it
is primed before RL, as an instruct model knows its tool syntax: on conversations that all
call the tool with the prompt's key and answer with its result, until the greedy model does
both on held-out conversations; then briefly, at a tenth of the learning rate, on
conversations of which only one in ten calls the tool and the others answer three random
digits. Priming teaches the call's format, copying the key and copying the result, on keys
disjoint from the training keys (:func:`priming_key`: half of the keys, by a hash; the data
rows use the others) and on codes drawn at random per
conversation. It starts knowing how to call and read but calling in a few percent of its
first turns, near chance (a digit in ten right): RL has to learn to call the tool.
:func:`reading_probe` shows that the answers follow the tool: the tool returns a code the
row does not hold, and the greedy answer is
checked against it (``python -m rlwire.trainer.bench --reading MODEL_DIR``).
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
    "priming_key",
    "reading",
    "reading_probe",
    "row_table",
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


def lookup(key: str, *, table: dict[str, str]) -> str:
    """Look up the code stored under a key.

    Args:
        key: three letters from a to j, as given in the prompt.
        table: the codes by key (the data row's: not the model's to give).
    """
    if len(key) != KEY_LENGTH or any(c not in LETTERS for c in key):
        raise ValueError(f"no entry {key!r}: keys are {KEY_LENGTH} letters from a to j")
    if key not in table:
        raise ValueError(f"no entry {key!r}: the key is the one in the prompt")
    return table[key]


def priming_key(key: str) -> bool:
    """Whether ``key`` is one of the keys priming uses: a fixed half of the keys, by a hash
    (a split by a feature of the letters, the parity of their places' sum, left the primed
    model writing half of the other keys wrong); data rows use the others, so no training
    key was seen in priming."""
    return hashlib.sha256(key.encode()).digest()[0] % 2 == 0


def _key(rng: random.Random, priming: bool) -> str:
    while True:
        key = "".join(rng.choice(LETTERS) for _ in range(KEY_LENGTH))
        if priming_key(key) == priming:
            return key


def _code(rng: random.Random) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(CODE_LENGTH))


def lookup_examples(count: int, *, seed: int) -> list[tuple[str, str]]:
    """``count`` ``(key, code)`` pairs, deterministic in ``seed``: keys outside priming's,
    each code drawn at random for its row."""
    rng = random.Random(seed)
    return [(_key(rng, priming=False), _code(rng)) for _ in range(count)]


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
    """A lookup row: the key as the user's message, the row's table (its key's code) for the
    tool in ``extra_info`` (verl's ``tools_kwargs``)."""
    return Example(
        prompt=prompt,
        answer=answer,
        data_source=source,
        extra_info={"tools_kwargs": {"lookup": {"create_kwargs": {"table": {prompt: answer}}}}},
        messages=[{"role": "user", "content": prompt}],
    )


def row_table(row: dict) -> dict[str, str]:
    """The table of an agent's row (:func:`rlwire.trainer.agent.function.agent_row`)."""
    return row["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"]["table"]


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
    key, code = _key(rng, priming=True), _code(rng)
    pieces = [(f"<|user|>{key}<eos><|assistant|>", False)]
    if rng.random() < call_share:
        pieces.append((f"<tool_call>{CALL_HEAD}{key}{CALL_TAIL}</tool_call><eos>", True))
        pieces.append((f"<|tool|><tool_response>{code}</tool_response><eos><|assistant|>", False))
        answer = code
    else:
        answer = _code(rng)
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


def _continue(model, tokenizer, prefixes: list[str], count: int) -> list[str]:
    """The greedy model's next ``count`` tokens after each of ``prefixes``, decoded."""
    import torch

    ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes])
    with torch.no_grad():
        for _ in range(count):
            step = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, step], dim=1)
    return [tokenizer.decode(row[-count:]) for row in ids.tolist()]


def _opening(key: str) -> str:
    """A conversation up to the key in the model's call."""
    return f"<|user|>{key}<eos><|assistant|><tool_call>{CALL_HEAD}"


def _called(key: str, code: str) -> str:
    """A conversation whose call of ``key`` the tool answered with ``code``, up to the
    model's answer."""
    return (
        f"{_opening(key)}{key}{CALL_TAIL}</tool_call><eos><|tool|><tool_response>{code}"
        "</tool_response><eos><|assistant|>"
    )


def _share(values: list[str], targets: list[str]) -> float:
    return sum(v == t for v, t in zip(values, targets, strict=True)) / len(targets)


def _written(model, tokenizer, keys: list[str]) -> list[str]:
    return _continue(model, tokenizer, [_opening(k) for k in keys], KEY_LENGTH)


def _answered(model, tokenizer, keys: list[str], codes: list[str]) -> list[str]:
    called = [_called(k, c) for k, c in zip(keys, codes, strict=True)]
    return _continue(model, tokenizer, called, CODE_LENGTH)


def reading(model, tokenizer, keys: list[str], codes: list[str]) -> tuple[float, float]:
    """The two skills, greedy, each given what precedes it: the share of ``keys`` the model
    writes right in its call, and the share of answers that are the code the tool returned
    (``codes``, one per key)."""
    written = _written(model, tokenizer, keys)
    return _share(written, keys), _share(_answered(model, tokenizer, keys, codes), codes)


def reading_probe(model, tokenizer, *, count: int = 64, seed: int = 0) -> dict[str, float]:
    """The probe that answers follow the tool: ``count`` data rows (:func:`lookup_examples`
    with ``seed``: keys priming never used), greedy, the call made and the tool's result
    given. ``follows_tool``: the share of answers that are the code the tool returned when
    it returns a wrong one (not the row's); ``row_code``: the share that are the row's code
    then (a model that knew the codes would answer with it); ``follows_row_tool``: the share
    that are the code when the tool returns the row's own; ``key_written``: the share of
    calls whose key is the prompt's."""
    rows = lookup_examples(count, seed=seed)
    keys, right = [key for key, _ in rows], [code for _, code in rows]
    rng = random.Random(seed + 7)
    wrong = []
    for code in right:
        other = _code(rng)
        while other == code:
            other = _code(rng)
        wrong.append(other)
    answered = _answered(model, tokenizer, keys, wrong)
    return {
        "key_written": _share(_written(model, tokenizer, keys), keys),
        "follows_tool": _share(answered, wrong),
        "row_code": _share(answered, right),
        "follows_row_tool": _share(_answered(model, tokenizer, keys, right), right),
    }


def build_lookup_model(
    directory: str | Path, *, seed: int = 0, hidden: int = 96, layers: int = 2
) -> Path:
    """Create (once) the lookup task's tiny model and tokenizer in ``directory``, primed
    (see the module's docstring); return it."""
    rng = random.Random(seed)
    check = random.Random(seed + 1)
    held_out = [_key(check, priming=True) for _ in range(32)]  # priming's keys, unseen codes
    held_codes = [_code(check) for _ in held_out]

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

        def skilled() -> bool:
            return min(reading(model, tokenizer, held_out, held_codes)) >= SKILLED

        done = 0
        while done < PRIMING_MAX_STEPS and not skilled():
            train(PRIMING_CHECK_EVERY, 1.0)
            done += PRIMING_CHECK_EVERY
        if not skilled():
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
