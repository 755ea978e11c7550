"""How one rank's share of a mini-batch is cut into micro-batches: ``micro_batch_size``
consecutive rows, or token budgets (verl's ``use_dynamic_bsz``); and how a batch is shared
over the actor ranks by token count (verl's ``trainer.balance_batch``, :func:`rank_shares`).

Token budgets group the rows into micro-batches whose real tokens (prompt + response, from
the masks) stay within ``max_tokens``, balanced by token count: the largest differencing
method (Karmarkar-Karp) partitions the rows into the fewest parts that fit, and a row longer
than the budget gets a part of its own. Every rank of a group must run as many
micro-batches as the others (FSDP's collectives in backward), so the count is the most any
rank needs (:func:`agree_count`, one all-reduce) and ranks that need fewer split into that
many.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from ..rollout.common import response_lengths

__all__ = [
    "agree_count",
    "balanced_partition",
    "micro_batch_count",
    "rank_shares",
    "row_tokens",
    "split_rows",
    "token_budget_partition",
]


def row_tokens(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> list[int]:
    """Each row's real tokens: its prompt's (``prompt_mask`` ``(B, P)`` summed) and its
    response's (up to the last 1 of ``response_mask`` ``(B, T)``: a multi-turn response's
    environment tokens count); ``B`` ints."""
    return (prompt_mask.sum(dim=1) + response_lengths(response_mask)).tolist()


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """The indices of ``lengths`` in ``parts`` groups of near-equal sums (the largest
    differencing method: the two partial partitions that differ most are merged, the
    heaviest group of one with the lightest of the other, until one is left).

    Returns ``parts`` groups, each sorted, ordered by their first index; every index is in
    exactly one. Deterministic (ties broken by index).

    Raises:
        ValueError: ``parts`` is not in ``[1, len(lengths)]``.
    """
    if not 1 <= parts <= len(lengths):
        raise ValueError(f"parts: {parts} is not allowed; use 1 to {len(lengths)} (the rows)")
    # A partial partition: (-spread, tie, [(sum, indices) per group, heaviest first]).
    heap = []
    for i, length in enumerate(lengths):
        groups = [(length, [i])] + [(0, []) for _ in range(parts - 1)]
        heap.append((-length, i, groups))
    heapq.heapify(heap)
    tie = len(lengths)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [
            (a_sum + b_sum, a_rows + b_rows)
            for (a_sum, a_rows), (b_sum, b_rows) in zip(first, reversed(second), strict=True)
        ]
        merged.sort(key=lambda group: (-group[0], group[1][:1]))
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], tie, merged))
        tie += 1
    result = [sorted(rows) for _, rows in heap[0][2]]
    return sorted(result, key=lambda rows: rows[0] if rows else math.inf)


def rank_shares(lengths: Sequence[int], world: int) -> list[list[int]]:
    """The rows (indices of ``lengths``, each row's real tokens) in ``world`` shares of equal
    size with near-equal token sums: the longest row first, each to the lightest share that
    still has room.

    Returns ``world`` sorted lists of ``len(lengths) / world`` indices, every row in exactly
    one; the heaviest share exceeds the lightest by at most the longest row.

    Raises:
        ValueError: ``len(lengths)`` does not split into ``world`` equal shares.
    """
    if world < 1 or len(lengths) % world:
        raise ValueError(f"rank_shares: {len(lengths)} rows do not split over {world} ranks")
    size = len(lengths) // world
    sums = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min((r for r in range(world) if len(shares[r]) < size), key=lambda r: sums[r])
        sums[rank] += lengths[i]
        shares[rank].append(i)
    return [sorted(share) for share in shares]


def _fits(groups: list[list[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    return all(len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens for g in groups)


def micro_batch_count(lengths: Sequence[int], max_tokens: int) -> int:
    """The fewest groups :func:`balanced_partition` splits ``lengths`` into with every group
    within ``max_tokens`` (or a single row)."""
    _check_budget(max_tokens)
    count = max(1, math.ceil(sum(lengths) / max_tokens))
    while count < len(lengths) and not _fits(
        balanced_partition(lengths, count), lengths, max_tokens
    ):
        count += 1
    return count


def token_budget_partition(
    lengths: Sequence[int], max_tokens: int, *, count: int | None = None
) -> list[list[int]]:
    """The rows (indices of ``lengths``, each row's real tokens) in micro-batches of at most
    ``max_tokens`` tokens each (a longer row alone), balanced by token count.

    Args:
        lengths: each row's real tokens.
        max_tokens: the budget of one micro-batch.
        count: how many micro-batches (another rank may need more than this one); None:
            :func:`micro_batch_count`. At least that, at most ``len(lengths)``.

    Returns:
        ``count`` groups of row indices, each sorted, ordered by their first index, every row
        in exactly one, each within the budget (or a single row).

    Raises:
        ValueError: ``max_tokens < 1``, or ``count`` out of range.
    """
    fewest = micro_batch_count(lengths, max_tokens)
    count = fewest if count is None else count
    if not fewest <= count <= len(lengths):
        raise ValueError(
            f"count: {count} is not allowed; use {fewest} (the fewest micro-batches within "
            f"{max_tokens} tokens) to {len(lengths)} (the rows)"
        )
    groups = balanced_partition(lengths, count)
    if _fits(groups, lengths, max_tokens):
        return groups
    # Rare: more groups balanced afresh broke the budget. Split the fewest that fit instead
    # (halving a group never makes a sum larger), the heaviest group first.
    groups = balanced_partition(lengths, fewest)
    while len(groups) < count:
        heaviest = max((g for g in groups if len(g) > 1), key=lambda g: sum(lengths[i] for i in g))
        groups.remove(heaviest)
        halves = balanced_partition([lengths[i] for i in heaviest], 2)
        groups += [[heaviest[j] for j in half] for half in halves]
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def agree_count(count: int, *, device: torch.device, group=None) -> int:
    """The most micro-batches any rank of ``group`` (None: the default group) needs: an
    all-reduce when ``torch.distributed`` is initialised with more than one rank (every
    rank must call it), else ``count``. ``device``: where the collective's tensor lives
    (the group's backend's: the CPU for gloo, a GPU for NCCL)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return count
    most = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most.item())


def split_rows(
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rows: int,
    max_tokens: int | None,
    group=None,
) -> list[slice] | list[torch.Tensor]:
    """One rank's mini-batch share as micro-batches: consecutive ``rows`` rows each
    (slices) when ``max_tokens`` is None, else token-budget groups (1-D int64 tensors of
    row indices on the masks' device; :func:`token_budget_partition`, the count agreed over
    ``group`` by :func:`agree_count`: a collective)."""
    total = prompt_mask.shape[0]
    if max_tokens is None:
        return [slice(s, min(s + rows, total)) for s in range(0, total, rows)]
    lengths = row_tokens(prompt_mask, response_mask)
    count = agree_count(
        micro_batch_count(lengths, max_tokens), device=prompt_mask.device, group=group
    )
    groups = token_budget_partition(lengths, max_tokens, count=count)
    return [torch.tensor(g, dtype=torch.int64, device=prompt_mask.device) for g in groups]


def _check_budget(max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens: {max_tokens} is not allowed; use an int >= 1")
