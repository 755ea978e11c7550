"""Token-id rows to a :class:`Rollout` and back: what the engines that take and return token
ids (``vllm``, ``vllm_server``) share."""

from __future__ import annotations

import torch

from .common import Rollout

__all__ = ["Row", "continuation_rows", "token_rollout"]

Row = tuple[list[int], list[int], list[float]]
"""``(prompt tokens, response tokens, their log-probs)``."""


def token_rollout(tokenizer, rows: list[Row]) -> Rollout:
    """One batch of rows: prompts left-padded, responses right-padded (a response runs up to
    and including its eos), texts decoded with the trainer's tokenizer."""
    pad = tokenizer.pad_token_id
    width_p = max(len(p) for p, _, _ in rows)
    width_r = max(len(r) for _, r, _ in rows)
    prompt_ids = torch.full((len(rows), width_p), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), width_p), dtype=torch.long)
    response_ids = torch.full((len(rows), width_r), pad, dtype=torch.long)
    response_mask = torch.zeros((len(rows), width_r), dtype=torch.long)
    logprobs = torch.zeros((len(rows), width_r), dtype=torch.float32)
    for row, (prompt, tokens, values) in enumerate(rows):
        prompt_ids[row, width_p - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, width_p - len(prompt) :] = 1
        response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        response_mask[row, : len(tokens)] = 1
        logprobs[row, : len(tokens)] = torch.tensor(values, dtype=torch.float32)
    texts = tokenizer.batch_decode(
        response_ids * response_mask + pad * (1 - response_mask), skip_special_tokens=True
    )
    return Rollout(
        prompt_ids, prompt_mask, response_ids, response_mask, logprobs, texts, pad_id=pad
    )


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
