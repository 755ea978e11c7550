"""Scoring a generated batch in the driver: the reward function, then the shaping that follows
it (:mod:`rlwire.trainer.algorithms.shaping`), and with dynamic sampling
(:mod:`rlwire.trainer.algorithms.dynamic_sampling`) the groups kept and the generation batches it
took."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import RunError
from ..rollout import Rollout
from .dynamic_sampling import varied_groups
from .shaping import overlong_penalty

__all__ = ["Scored", "fill", "score"]


@dataclasses.dataclass(slots=True)
class Scored:
    """A batch's rewards (``(B,)``), the reward's numeric extras (batch means, for the
    metrics) and the seconds scoring took; with dynamic sampling, the generation batches
    and the groups dropped for equal ``algorithm.filter_groups.metric``."""

    rewards: torch.Tensor
    extra: dict[str, float]
    seconds: float
    gen_batches: int | None = None
    filtered_groups: int | None = None
    kept_groups: list[int] | None = None
    """With dynamic sampling: the kept groups' places among all the groups scored, in
    order (the first batch's groups first)."""
    sample_extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """A per-sample reward function's numeric extras, ``(B,)`` float32 on the CPU each,
    row for row with ``rewards`` (they stay in the driver: the actors get the rewards
    only)."""


def score(config, reward_fn, batch: Rollout) -> Scored:
    """The rewards of ``batch`` (with its ``examples``), shaped."""
    start = time.perf_counter()
    columns: dict[str, torch.Tensor] = {}
    if config.agent.scores:  # each session's reward from the agent function or environment
        assert batch.trajectories is not None, "agent: samples without sessions"
        rewards = torch.tensor([sum(t.rewards) for t in batch.trajectories], dtype=torch.float32)
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        if config.agent.function is not None:  # its failures are zero or dropped already
            columns = _agent_extras(batch.trajectories)
        elif bad:
            raise RunError(
                f"agent.environment {config.agent.environment!r}: the step rewards of "
                f"conversation {bad[0]} sum to {rewards[bad[0]].item()}; rewards must be finite "
                f"numbers ({len(bad)} of {len(rewards)} were not)"
            )
    else:
        rewards, columns = reward_fn(batch.examples, batch.texts, lambda: _response_ids(batch))
    # a TRL function's None (not applicable) is NaN in its column: the mean of the others
    extra = {key: float(column.nanmean()) for key, column in columns.items()}
    overlong = config.reward.overlong_buffer
    if overlong.enable:  # DAPO's shaping, after the reward function
        lengths = batch.response_mask.sum(dim=1)
        penalty = overlong_penalty(lengths, config.rollout.max_new_tokens, overlong)
        rewards = rewards + penalty
        extra = {
            **extra,
            "overlong_penalty": float(penalty.mean()),
            "overlong_fraction": float((penalty < 0).float().mean()),
        }
    return Scored(rewards, extra, time.perf_counter() - start, sample_extras=columns)


def _response_ids(batch: Rollout) -> list[list[int]]:
    """Each sample's response token ids (the loss-masked ones: the model's own tokens)."""
    return [
        ids[mask.bool()].tolist()
        for ids, mask in zip(batch.response_ids, batch.response_mask, strict=True)
    ]


def _agent_extras(trajectories) -> dict[str, torch.Tensor]:
    """The numeric extras every session's agent returned, as ``(B,)`` columns (a key some
    session lacks, a failed one's for instance, is left out)."""
    keys = set(trajectories[0].extras) if trajectories else set()
    for t in trajectories[1:]:
        keys &= set(t.extras)
    return {
        k: torch.tensor([t.extras[k] for t in trajectories], dtype=torch.float32)
        for k in sorted(keys)
    }


def _kept_groups(config, scored: Scored, batch: Rollout, filtering: bool) -> torch.Tensor:
    """``(groups,)`` bool: the groups ``fill`` keeps: with dynamic sampling those whose metric
    differs; with ``agent.failure=drop`` those whose every session succeeded."""
    n = config.rollout.n
    keep = (
        varied_groups(_grouped_by(config, scored), n)
        if filtering
        else torch.ones(len(batch) // n, dtype=torch.bool)
    )
    if config.agent.function is not None and config.agent.failure == "drop":
        assert batch.trajectories is not None, "agent.function: samples without sessions"
        failed = torch.tensor([t.stop == "agent_failed" for t in batch.trajectories])
        keep &= ~failed.view(-1, n).any(dim=1)
    return keep


def _grouped_by(config, scored: Scored) -> torch.Tensor:
    """The ``(B,)`` values whose equality within a group drops it:
    ``algorithm.filter_groups.metric``, the reward or one of its extras."""
    metric = config.algorithm.filter_groups.metric
    if metric == "reward":
        return scored.rewards
    if metric not in scored.sample_extras:
        given = ", ".join(repr(k) for k in scored.sample_extras) or "none"
        raise RunError(
            f"algorithm.filter_groups.metric={metric!r}: the reward returned no per-sample "
            f"{metric!r} (its extras: {given}); use 'reward' or an extra key the reward "
            "function returns in its dict"
        )
    return scored.sample_extras[metric]


def fill(
    config, reward_fn, batch: Rollout, generate_more: Callable[[int], Rollout]
) -> tuple[Rollout, Scored]:
    """Dynamic sampling: score ``batch``, keep its groups whose
    ``algorithm.filter_groups.metric`` differs (and, with ``agent.failure=drop``, whose
    sessions all succeeded), and call
    ``generate_more(missing)`` (more groups: the next prompts; ``missing`` is how many are
    still wanted) until ``data.train_batch_size`` groups are kept; the batch of the first
    that many, and its scores."""
    n, required = config.rollout.n, config.data.train_batch_size
    filtering = config.algorithm.filter_groups.enable
    metric = config.algorithm.filter_groups.metric
    differing = "rewards differ" if metric == "reward" else f"{metric!r} differs"
    if not filtering:  # agent.failure=drop alone
        differing = "agent sessions all succeeded"
    elif config.agent.function is not None and config.agent.failure == "drop":
        differing += " and whose agent sessions all succeeded"
    limit = config.algorithm.filter_groups.max_num_gen_batches
    parts: list[Rollout] = []
    extras: list[dict[str, float]] = []
    columns: list[dict[str, torch.Tensor]] = []  # the kept rows' per-sample extras
    generated, dropped, seconds, seen = 0, 0, 0.0, 0
    kept_groups: list[int] = []
    while True:
        generated += 1
        scored = score(config, reward_fn, batch)
        seconds += scored.seconds
        extras.append(scored.extra)
        keep = _kept_groups(config, scored, batch, filtering)
        dropped += int((~keep).sum())
        kept_groups += (keep.nonzero().flatten() + seen).tolist()
        seen += len(keep)
        rows = keep.repeat_interleave(n).nonzero().flatten()
        batch.rewards = scored.rewards
        parts.append(batch.select(rows))
        columns.append({key: column[rows] for key, column in scored.sample_extras.items()})
        kept = sum(len(p) for p in parts) // n
        if kept >= required:
            break
        if limit and generated >= limit:
            raise RunError(
                f"algorithm.filter_groups: {generated} generation batches gave {kept} of "
                f"{required} prompt groups whose {differing} (max_num_gen_batches="
                f"{limit}); raise it, or 0 for no limit"
            )
        batch = generate_more(required - kept)
    whole = Rollout.concat(parts).select(slice(0, required * n))
    assert whole.rewards is not None  # every part's set above
    extra: dict[str, Any] = {}
    for key in dict.fromkeys(k for e in extras for k in e):  # over the batches giving it
        given = [e[key] for e in extras if key in e]
        extra[key] = sum(given) / len(given)
    keys = [k for k in columns[0] if all(k in c for c in columns)]
    kept_columns = {k: torch.cat([c[k] for c in columns])[: required * n] for k in keys}
    return whole, Scored(
        whole.rewards,
        extra,
        seconds,
        generated,
        dropped,
        kept_groups[:required],
        sample_extras=kept_columns,
    )
