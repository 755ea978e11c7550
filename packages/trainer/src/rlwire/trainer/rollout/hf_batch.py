"""The ``hf`` engine's continuous batch: a Hugging Face causal LM decoding every live request
one token per step from one KV cache, with requests joining and leaving between steps.

Why not transformers' own continuous batching (``transformers.generation.continuous_batching``,
5.24): it samples every request with one ``torch.multinomial`` on the process's global
generator (``model_runner._sample``) and ``add_request`` takes no seed, so a request's tokens
depend on what else is in the batch and when it arrived; and its loop runs in a thread of
its own with no hook between two steps, where a weight update must be written in and the
version of each token recorded. This batch gives each request a generator of its own and
leaves the loop to :class:`~rlwire.trainer.rollout.requests.EngineCore`.

Sampling is by inverse transform, batched: each request draws one uniform number per token
from its own ``random.Random(seed)``, and its token is the first whose cumulative
probability under ``softmax(logits / temperature)`` passes it (exact sampling from that
distribution; one ``torch.multinomial`` per row with a generator each measured 0.71x the
samples/s of the default job).

Layout: the cache rows are the live requests in :attr:`HFBatch.rows` order, left-padded to
the longest (``(B, heads, L, head_dim)`` per layer, ``attention`` ``(B, L)`` int64, 0 on
padding); each cached request's last sampled token is not in the cache yet (the next step
feeds it). A request that joins is prefilled on its whole context (prompt, then what it
sampled already: a request whose cache was dropped at a weight update) and its rows padded
into the batch's.
"""

from __future__ import annotations

import inspect
import random
import time
from typing import Any

import torch

from .requests import Live

__all__ = ["HFBatch", "truncated"]


class _Row:
    """A request's own state in the batch: its generator (uniform draws, seeded by the
    request), and whether its context is cached."""

    __slots__ = ("cached", "generator")

    def __init__(self, seed: int) -> None:
        self.generator = random.Random(seed)
        self.cached = False


class HFBatch:
    """The :class:`~rlwire.trainer.rollout.requests.Stepper` of the ``hf`` and ``paced``
    engines.

    Args:
        model: a Hugging Face causal LM (eval mode; its device is the batch's).
        eos_id: the end-of-sequence token (None: requests end at their length only).
        pad_id: the token padding rows carry (masked out).
        pace_s: wall seconds a step takes at least, the rest waited out without using the
            CPU (``rollout.backend=paced``); 0: as fast as it goes.
    """

    def __init__(self, model, *, eos_id: int | None, pad_id: int, pace_s: float = 0.0) -> None:
        self.model, self.eos_id, self.pad_id, self.pace_s = model, eos_id, pad_id, pace_s
        self.rows: list[Live] = []
        # transformers 5.24 renamed the forward's past_key_values to cache (5.17 has the old)
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self.cache: Any = None  # a transformers DynamicCache over self.rows, or None
        self.attention: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def step(self, admitted: list[Live], running: list[Live], version: int) -> None:
        began = time.perf_counter()
        for live in admitted:
            live.state = _Row(live.request.seed)
        fresh = admitted + [r for r in running if not r.state.cached]
        logits = []
        if self.rows:
            logits.append(self._decode())
        if fresh:
            logits.append(self._prefill(fresh))
        self._sample(torch.cat(logits), version)
        if self.pace_s:
            left = began + self.pace_s - time.perf_counter()
            if left > 0:
                time.sleep(left)

    def release(self, ended: list[Live]) -> None:
        gone = {id(r) for r in ended}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.forget()
            return
        index = torch.tensor(keep, device=self.device)
        attention = self.attention[index]  # type: ignore[index]
        # the leading columns that are padding in every remaining row go
        first = int(attention.any(dim=0).nonzero()[0])
        layers = [(k[index, :, first:], v[index, :, first:]) for k, v in self._layers()]
        self.rows = [self.rows[i] for i in keep]
        self.attention = attention[:, first:]
        self._set_cache(layers)

    def forget(self) -> None:
        """Drop the cache: every request in it is prefilled again on its whole context at
        the next step (``rollout.kv_on_update=recompute``, after a weight update)."""
        for live in self.rows:
            live.state.cached = False
        self.rows, self.cache, self.attention = [], None, None

    # --- internals ---------------------------------------------------------------------
    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.cache is not None
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def _set_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(ddp_cache_data=layers)

    def _decode(self) -> torch.Tensor:
        """One token for every cached row (its last sampled one in); their next logits."""
        assert self.attention is not None
        ids = torch.tensor([[r.token_ids[-1]] for r in self.rows], device=self.device)
        attention = torch.cat([self.attention, self.attention.new_ones((len(self.rows), 1))], 1)
        positions = attention.sum(dim=1, keepdim=True) - 1
        out = self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: self.cache},
        )
        self.cache, self.attention = _cache_of(out), attention
        return out.logits[:, -1].float()

    def _prefill(self, fresh: list[Live]) -> torch.Tensor:
        """Each of ``fresh`` on its whole context, its cache rows joined to the batch's; their
        next logits."""
        contexts = [list(r.request.prompt_ids) + r.token_ids for r in fresh]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(fresh), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(fresh), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            attention[row, width - len(context) :] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (torch.cumsum(attention, dim=1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,  # the next token's only: not every position's
        )
        new = [(layer.keys, layer.values) for layer in _cache_of(out).layers]
        if self.rows:
            assert self.attention is not None
            length = max(self.attention.shape[1], width)
            old = self._layers()
            layers = [
                (
                    torch.cat([_left_pad(k0, length), _left_pad(k1, length)]),
                    torch.cat([_left_pad(v0, length), _left_pad(v1, length)]),
                )
                for (k0, v0), (k1, v1) in zip(old, new, strict=True)
            ]
            attention = torch.cat(
                [_left_pad_mask(self.attention, length), _left_pad_mask(attention, length)]
            )
        else:
            layers = new
        self._set_cache(layers)
        self.attention = attention
        self.rows += fresh
        for live in fresh:
            live.state.cached = True
        return out.logits[:, -1].float()

    def _sample(self, logits: torch.Tensor, version: int) -> None:
        """Each row's next token from its request's distribution, by inverse transform: the
        first token whose cumulative probability passes a uniform draw of the request's own
        generator (one batched pass, whatever the rows' temperatures)."""
        rows = self.rows
        device = logits.device
        greedy = torch.tensor([r.request.greedy for r in rows], device=device)
        temperature = torch.tensor(
            [1.0 if r.request.greedy else r.request.temperature for r in rows], device=device
        )
        logp = torch.log_softmax(logits / temperature.unsqueeze(1), dim=-1)
        if any(r.request.truncated for r in rows):
            logp = truncated(logp, [r.request for r in rows])
        cdf = logp.double().exp().cumsum(dim=-1)
        draws = torch.tensor([r.state.generator.random() for r in rows], dtype=torch.float64)
        target = (draws.to(device) * cdf[:, -1]).unsqueeze(1)
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
        sampled = sampled.clamp(max=logp.shape[1] - 1)
        tokens = torch.where(greedy, logp.argmax(dim=-1), sampled)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        for live, token, logprob in zip(rows, tokens.tolist(), chosen.tolist(), strict=True):
            live.append(token, logprob, version, self.eos_id)


def truncated(logp: torch.Tensor, requests: list) -> torch.Tensor:
    """``(B, V)`` log-probs with each row cut to its request's ``top_k`` most likely tokens,
    then to the smallest set of them whose probability reaches its ``top_p`` (vLLM's order:
    the nucleus is taken of the top-k distribution), renormalised; rows with neither as
    they are. Ties break by token id (a stable sort)."""
    device, vocab = logp.device, logp.shape[-1]
    cut = [r.truncated for r in requests]
    top_k = torch.tensor(
        [r.top_k if c and r.top_k else vocab for r, c in zip(requests, cut, strict=True)],
        device=device,
    )
    top_p = torch.tensor(
        [r.top_p if c else 1.0 for r, c in zip(requests, cut, strict=True)], device=device
    )
    ordered, order = logp.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device).expand_as(ordered)
    ordered = torch.log_softmax(ordered.masked_fill(ranks >= top_k.unsqueeze(1), -torch.inf), -1)
    probs = ordered.exp()
    before = probs.cumsum(dim=-1) - probs  # the mass of the likelier tokens
    ordered = ordered.masked_fill(before >= top_p.unsqueeze(1).to(probs.dtype), -torch.inf)
    out = torch.full_like(logp, -torch.inf).scatter(1, order, ordered)
    return torch.log_softmax(out, dim=-1)


def _cache_of(out):
    """The model output's cache (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, H, L, D)`` zero-padded on the left of ``L`` to ``length``."""
    missing = length - t.shape[2]
    return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))


def _left_pad_mask(t: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - t.shape[1]
    return t if missing == 0 else torch.nn.functional.pad(t, (missing, 0))
