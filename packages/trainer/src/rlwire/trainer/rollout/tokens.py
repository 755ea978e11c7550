"""Token-id rows to a :class:`Rollout` and back: what the engines that take and return token
ids share, and the agent loop and the request paths with them."""

from __future__ import annotations

import torch

from .common import Rollout

__all__ = ["Row", "completions_rollout", "continuation_rows", "token_rollout"]

Row = tuple[list[int], list[int], list[float]]
"""``(prompt tokens, response tokens, their log-probs)``."""


def token_rollout(
    tokenizer,
    rows: list[Row],
    *,
    masks: list[list[int]] | None = None,
    versions: list[list[int]] | None = None,
) -> Rollout:
    """One batch of rows: prompts left-padded, responses right-padded (a response runs up to
    and including its eos), texts decoded with the trainer's tokenizer (special tokens
    skipped). ``masks``: each response's loss mask (default 1 on every token; a
    conversation's 0 on the environment's); ``versions``: each response token's weight
    version (a request engine's record), else unset."""
    pad = tokenizer.pad_token_id
    width_p = max(len(p) for p, _, _ in rows)
    width_r = max(len(r) for _, r, _ in rows)
    shape = (len(rows), width_r)
    prompt_ids = torch.full((len(rows), width_p), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), width_p), dtype=torch.long)
    response_ids = torch.full(shape, pad, dtype=torch.long)
    response_mask = torch.zeros(shape, dtype=torch.long)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    stamped = None if versions is None else torch.zeros(shape, dtype=torch.long)
    for row, (prompt, tokens, values) in enumerate(rows):
        prompt_ids[row, width_p - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, width_p - len(prompt) :] = 1
        response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask = [1] * len(tokens) if masks is None else masks[row]
        response_mask[row, : len(tokens)] = torch.tensor(mask, dtype=torch.long)
        logprobs[row, : len(tokens)] = torch.tensor(values, dtype=torch.float32)
        if stamped is not None and versions is not None:
            stamped[row, : len(tokens)] = torch.tensor(versions[row], dtype=torch.long)
    texts = tokenizer.batch_decode([tokens for _, tokens, _ in rows], skip_special_tokens=True)
    return Rollout(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        logprobs,
        texts,
        pad_id=pad,
        versions=stamped,
    )


def completions_rollout(tokenizer, prompts: list[list[int]], completions: list) -> Rollout:
    """:func:`token_rollout` of request :class:`~rlwire.trainer.rollout.requests.Completion` s
    (one per prompt, token ids), with the weight version of each token."""
    rows = [(p, c.token_ids, c.logprobs) for p, c in zip(prompts, completions, strict=True)]
    return token_rollout(tokenizer, rows, versions=[c.versions for c in completions])


def continuation_rows(batch: Rollout) -> list[Row]:
    """Each row of ``batch`` as its real prompt tokens, response tokens and log-probs (what a
    continuation request sends and extends)."""
    rows = []
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        real = batch.response_mask[i].bool()
        rows.append(
            (prompt, batch.response_ids[i][real].tolist(), batch.logprobs[i][real].tolist())
        )
    return rows
