"""What rollout engines hand back, and the log-probabilities the actor recomputes.

Shapes: ``B = prompts x n`` sequences (the ``n`` samples of a prompt are
consecutive), ``P`` prompt tokens (left-padded), ``T`` response tokens.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "Rollout",
    "WeightsDigest",
    "collate",
    "sequence_logprobs",
    "split_groups",
    "weights_digest",
]


@dataclasses.dataclass(slots=True)
class Rollout:
    prompt_ids: torch.Tensor
    """``(B, P)`` int64, left-padded."""
    prompt_mask: torch.Tensor
    """``(B, P)`` int64, 1 for real prompt tokens."""
    response_ids: torch.Tensor
    """``(B, T)`` int64 sampled tokens (padding after an end-of-sequence token)."""
    response_mask: torch.Tensor
    """``(B, T)`` int64, 1 up to and including the first end-of-sequence token."""
    logprobs: torch.Tensor
    """``(B, T)`` float32 log-probability of each sampled token under the sampling
    distribution (temperature applied), as the rollout engine saw it."""
    texts: list[str]
    """Decoded responses (special tokens skipped)."""


def sequence_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
):
    """``(B, T)`` log-probabilities of ``response_ids`` under ``model`` (one forward pass).

    Positions follow the attention mask, so left padding does not shift them.
    With ``with_entropy`` also returns the ``(B, T)`` entropy of each token's distribution.
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention = torch.cat([prompt_mask, torch.ones_like(response_ids)], dim=1)
    positions = (torch.cumsum(attention, dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
    steps = response_ids.shape[1]
    logits = logits[:, -steps - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


_SEQUENCE_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs")


def split_groups(batch: dict, n: int) -> list[dict]:
    """A generated batch (``prompts x n`` rows, see :func:`collate`) as one dict per prompt."""
    rows = batch["response_ids"].shape[0]
    groups = []
    for start in range(0, rows, n):
        group = {k: batch[k][start : start + n] for k in _SEQUENCE_KEYS}
        group["texts"] = batch["texts"][start : start + n]
        group["pad_id"] = batch["pad_id"]
        groups.append(group)
    return groups


def collate(parts: list[dict]) -> dict:
    """Concatenate generated batches: prompts left-padded and responses right-padded to
    the widest part (padding masked out, log-probs 0), texts joined."""
    pad = parts[0]["pad_id"]
    width_p = max(p["prompt_ids"].shape[1] for p in parts)
    width_r = max(p["response_ids"].shape[1] for p in parts)

    def padded(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        missing = width - t.shape[1]
        if missing == 0:
            return t
        return torch.nn.functional.pad(t, (missing, 0) if left else (0, missing), value=value)

    out = {
        "prompt_ids": torch.cat([padded(p["prompt_ids"], width_p, pad, True) for p in parts]),
        "prompt_mask": torch.cat([padded(p["prompt_mask"], width_p, 0, True) for p in parts]),
        "response_ids": torch.cat([padded(p["response_ids"], width_r, pad, False) for p in parts]),
        "response_mask": torch.cat([padded(p["response_mask"], width_r, 0, False) for p in parts]),
        "logprobs": torch.cat([padded(p["logprobs"], width_r, 0.0, False) for p in parts]),
        "texts": [t for p in parts for t in p["texts"]],
        "pad_id": pad,
    }
    return out


class WeightsDigest:
    """SHA-256 over ``(name, tensor)`` pairs as fp32 bytes, independent of their order;
    each tensor is hashed as it is added (nothing is kept but its digest)."""

    def __init__(self) -> None:
        self._parts: list[tuple[str, str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        import hashlib

        data = tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        self._parts.append((name, hashlib.sha256(data).hexdigest()))

    def hexdigest(self) -> str:
        import hashlib

        whole = hashlib.sha256()
        for name, digest in sorted(self._parts):
            whole.update(f"{name}:{digest};".encode())
        return whole.hexdigest()


def weights_digest(items) -> str:
    """The :class:`WeightsDigest` of ``(name, tensor)`` pairs."""
    digest = WeightsDigest()
    for name, tensor in items:
        digest.add(name, tensor)
    return digest.hexdigest()
