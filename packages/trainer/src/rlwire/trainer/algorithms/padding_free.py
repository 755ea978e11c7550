"""A micro-batch's forward with less padding: trimmed to its own longest prompt and response
(token-budget micro-batches), or packed into one row without padding (verl's
``use_remove_padding``).

Packed: the micro-batch's sequences (each row's real prompt tokens, then its response up to
its last real token) are laid end to end in one row of ``L`` tokens, with ``position_ids``
restarting at 0 for each sequence and no attention mask. Hugging Face transformers (5.x)
reads such position ids as packed sequences: ``sdpa``, ``eager`` and ``flex_attention``
get a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``, only with
no attention mask and no cache: ``use_cache=False`` is passed), and the flash-attention
kernels (``flash_attention_2``/``3``/``4``) run varlen attention from the same position
ids. Any other attention implementation is refused (``ValueError``), since it might attend
across sequences. Cost: ``sdpa`` and ``eager`` build an ``(L, L)`` mask (``eager`` also
``(heads, L, L)`` scores), so their attention grows with the square of the packed length,
of every sequence against every other, masked; flash attention's grows with each
sequence's own square only.
"""

from __future__ import annotations

import torch

from ..rollout import response_lengths, sequence_logprobs

__all__ = ["PACKED_ATTENTION", "attention_implementation", "micro_batch_logprobs"]

PACKED_ATTENTION = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
"""The attention implementations that keep packed sequences apart by their position ids."""


def attention_implementation(model: torch.nn.Module) -> str | None:
    """The Hugging Face attention implementation of ``model``, through wrappers that hold it
    as ``.module`` (FSDP1, Megatron's DDP) or forward attributes (PEFT); None when none is
    found."""
    seen: torch.nn.Module | None = model
    while seen is not None:
        config = getattr(seen, "config", None)
        kind = getattr(config, "_attn_implementation", None)
        if isinstance(kind, str):
            return kind
        seen = getattr(seen, "module", None)
    return None


def _check_packable(model: torch.nn.Module) -> None:
    kind = attention_implementation(model)
    if kind not in PACKED_ATTENTION:
        allowed = ", ".join(repr(k) for k in PACKED_ATTENTION)
        raise ValueError(
            f"actor.use_remove_padding: the model's attention implementation {kind!r} does not "
            f"keep packed sequences apart; load the model with one of {allowed}, or set "
            "actor.use_remove_padding=false"
        )


def _trimmed(prompt_ids, prompt_mask, response_ids, response_mask):
    """The columns some row needs: prompt columns from the first real token of any row,
    response columns up to the last real token of any row (at least one)."""
    real = prompt_mask.bool().any(dim=0)
    first = int(real.int().argmax()) if bool(real.any()) else prompt_mask.shape[1]
    width = max(1, int(response_lengths(response_mask).max()))
    return (
        prompt_ids[:, first:],
        prompt_mask[:, first:],
        response_ids[:, :width],
    )


def _packed(model, prompt_ids, prompt_mask, response_ids, response_mask, *, temperature, entropy):
    """``(N,)`` log-probs (and with ``entropy`` entropies: else None) of the ``N`` kept
    response tokens and their ``(row, column)`` in the ``(B, T)`` response, from one packed
    forward."""
    _check_packable(model)
    has_prompt = prompt_mask.bool().any(dim=1)
    if not bool(has_prompt.all()):
        row = int((~has_prompt).int().argmax())
        raise ValueError(
            f"row {row} of a micro-batch has no prompt token: its first response token has "
            "no context"
        )
    columns = torch.arange(response_ids.shape[1], device=response_ids.device)
    # each response up to its last real token, at least one: a graph to backward
    scored = columns < response_lengths(response_mask).clamp(min=1).unsqueeze(1)
    keep = torch.cat([prompt_mask.bool(), scored], dim=1)  # (B, P + T), row by row
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)[keep].unsqueeze(0)
    position_ids = (keep.cumsum(dim=1) - 1)[keep].unsqueeze(0)  # restarting at each row
    where = (keep.flatten().cumsum(0) - 1).view_as(keep)  # each kept token's packed index
    # the logits one packed position before a response token predict it
    targets = where[:, prompt_ids.shape[1] :][scored] - 1
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
    rows, cols = scored.nonzero(as_tuple=True)
    logp = torch.log_softmax(logits[targets].float() / temperature, dim=-1)
    token_logp = logp.gather(-1, response_ids[rows, cols].unsqueeze(-1)).squeeze(-1)
    entropies = -(logp.exp() * logp).sum(-1) if entropy else None
    return token_logp, entropies, rows, cols


def micro_batch_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    remove_padding: bool = False,
):
    """``(B, T)`` log-probabilities of ``response_ids`` under ``model`` (one forward pass),
    like :func:`rlwire.trainer.rollout.sequence_logprobs`, without the columns no row needs
    or, with ``remove_padding``, packed into one row (see the module docstring).

    Columns past the micro-batch's last real response token are 0; packed, every token past
    its own row's last real one (the first kept, at least) is 0. Other masked positions hold
    what the forward gives them, as in ``sequence_logprobs``: callers mask them. With
    ``with_entropy`` also returns the ``(B, T)`` entropy (0 where not computed).

    Args:
        prompt_ids, prompt_mask: ``(B, P)`` int64, left-padded.
        response_ids, response_mask: ``(B, T)`` int64, right-padded.

    Raises:
        ValueError: ``remove_padding`` with an attention implementation not in
            :data:`PACKED_ATTENTION`, or a scored row without a prompt token.
    """
    shape = response_ids.shape
    if remove_padding:
        token_logp, entropy, rows, columns = _packed(
            model,
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            temperature=temperature,
            entropy=with_entropy,
        )
        placed = []
        for values in (token_logp, entropy) if with_entropy else (token_logp,):
            full = values.new_zeros(shape)
            full[rows, columns] = values  # differentiable: index_put
            placed.append(full)
        return tuple(placed) if with_entropy else placed[0]
    p_ids, p_mask, r_ids = _trimmed(prompt_ids, prompt_mask, response_ids, response_mask)
    out = sequence_logprobs(
        model, p_ids, p_mask, r_ids, temperature=temperature, with_entropy=with_entropy
    )
    missing = shape[1] - r_ids.shape[1]
    parts = out if with_entropy else (out,)
    padded = tuple(torch.nn.functional.pad(t, (0, missing)) for t in parts)
    return padded if with_entropy else padded[0]
