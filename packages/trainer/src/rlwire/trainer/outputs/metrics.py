"""The schema of one line of ``metrics.jsonl``: what both modes record for every step."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..agent.trajectory import trajectory_metrics
from ..rollout import Rollout, response_lengths
from .metric_names import with_aliases

__all__ = [
    "StepMetrics",
    "UpdateMetrics",
    "mean_lag",
    "skipped_update_metrics",
    "step_record",
    "update_metrics",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class UpdateMetrics:
    """What one update reports: the scores of its batch and the actor ranks' losses."""

    reward_mean: float
    reward_std: float
    reward_extra: dict[str, float]
    """A per-sample reward's other numbers (batch means; written as ``reward_extra/<name>``)."""
    response_length: float
    """Mean response tokens per sample."""
    response_length_max: int
    """The most response tokens of a sample in the batch (one that reached
    ``rollout.max_new_tokens`` was cut there)."""
    response_length_min: int
    """The fewest response tokens of a sample in the batch."""
    policy_loss: float
    clip_fraction: float
    entropy: float
    kl_ref: float
    """k3 KL to the reference policy (0 without one)."""
    grad_norm: float
    kl_rollout: float
    """Mean of behaviour log-prob minus the proximal (the actor's, before the update)."""
    kl_behaviour_proximal: float
    """k3 estimate of KL(behaviour || proximal) per token."""
    rollout_is_mean: float
    """Mean importance ratio proximal / behaviour before truncation (per token, or per
    sequence with ``rollout_is=sequence``); about 1 when the samples are on-policy."""
    rollout_is_max: float
    """Largest such ratio in the batch."""
    rollout_is_truncated_fraction: float
    """Fraction of tokens (sequences) whose weight was truncated to ``rollout_is_threshold``."""
    rollout_rs_masked_fraction: float
    """Fraction of response tokens dropped from the loss by ``rollout_rs``."""
    optimizer_steps: int
    update_skipped: bool | None = None
    """True when no sample held a token to train on (every agent session failed before the
    model answered): no update ran (the actor's weights and optimizer are as they were)."""
    """Optimizer steps this update took (mini-batches x epochs)."""
    lr_scale: float
    """The factor on ``actor.optim.lr`` this update took: below 1 where the
    staleness-aware step size acted (``actor.optim.stale_lr_kl``)."""
    version_span_max: int
    """Largest newest-minus-oldest token version within one sample (partial rollouts)."""
    continued_fraction: float
    """Fraction of samples continued across a weight sync (tokens of two versions)."""
    retained_grad_bytes: int
    grad_sync_policy: str
    tokens: int
    """Response tokens in the batch (not recorded; rates are computed from it)."""
    time_reward_s: float
    """Scoring the batch (the reward function, in the driver)."""
    time_old_logprob_s: float
    """The actor's proximal forward pass (0 when the update is exactly on-policy and
    reuses the training forward's log-probs; see ``TrainerConfig.reuses_training_logprobs``)."""
    time_ref_s: float
    """The reference model's forward pass (0 without one)."""
    time_forward_backward_s: float
    """Forward and backward passes of the update's micro-batches."""
    time_optimizer_s: float
    """Gradient clipping and optimizer steps."""
    time_actor_s: float
    """The whole update call on the slowest actor rank (the phases above plus moving the
    batch to the device, the correction and offloading); ``time_update_s`` minus this and
    ``time_reward_s`` is the driver's share: advantages, sharding, Ray calls and moving the
    batch between processes."""


@dataclasses.dataclass(kw_only=True, slots=True)
class StepMetrics(UpdateMetrics):
    """One step: the update's metrics, times and rates, and weight versions. Optional
    fields are written only when they apply (``None`` is left out of the file)."""

    step: int
    time_rollout_s: float
    time_update_s: float
    time_weight_sync_s: float
    weight_sync_gbps: float
    weight_sync_bytes: int | None = None
    """Bytes of the weights updated on a sync step (None on steps without one)."""
    weight_sync_wire_bytes: int | None = None
    """Bytes that travelled for them: less than ``weight_sync_bytes`` for a delta update."""
    weight_sync_delta_density: float | None = None
    """A delta update's share of elements that changed since the previous sync."""
    time_weight_export_s: float | None = None
    """On a sync step: actor rank 0 gathering the full weights (and copying them into the
    shared arena) beyond the checkpoint engine's own time."""
    tokens_per_s: float
    samples_per_s: float
    weight_version: int
    version_lag_mean: float
    version_lag_max: int
    gen_batches: int | None = None
    """With dynamic sampling: the generation batches this step took to fill its batch."""
    filtered_groups: int | None = None
    """With dynamic sampling: the prompt groups dropped because their rewards were equal
    (and with ``agent.failure=drop``, because an agent session of theirs failed)."""
    group_indices: list[int] | None = None
    """Fully async only: the data position of each prompt group trained (``step x
    data.train_batch_size + i`` for the i-th prompt of the data's step), so a resumed run
    can be checked for groups lost or trained twice."""
    rollout_restarts: int | None = None
    """Rollout workers replaced so far in this run (``rollout.max_restarts``; None with the
    hybrid engine, which has no rollout process)."""
    rollout_engines_live: int | None = None
    """Rollout engines in the weight group at the step's end (a replacement joins at the
    next sync)."""
    regenerated_groups: int | None = None
    """Prompt groups generated again this step because the worker generating them died."""
    dropped_samples: int | None = None
    """Fully async only: samples dropped for lagging more than ``async.max_version_lag``."""
    wait_for_samples_s: float | None = None
    """Fully async only: how long the queue took to gather the update's prompt groups (asked
    for while the previous update ran; the trainer's own wait is ``time_rollout_s``)."""
    rollout_paused_s: float | None = None
    """Fully async only: rollout worker time spent paused by the staleness bound (summed
    over the workers, since the previous step's line)."""
    rollout_sync_wait_s: float | None = None
    """Fully async only: rollout worker time from being asked to take a sync until its
    weights were written in (waiting for the transfer, and without partial rollouts for
    its groups in flight to end; summed over the workers, since the previous step's
    line). Its requests in flight go on meanwhile; it starts no new group."""
    rollout_commit_s: float | None = None
    """Fully async only: rollout worker time with generation stopped to write new weights
    in (the commit, between two decoding steps: the only pause a sync costs an engine that
    receives beside the weights in use); summed over the workers, since the previous
    step's line. Against ``time_weight_sync_s``: the share of a sync the engines stop."""
    time_generate_s: float | None = None
    """The rollout engines' own seconds on the generation calls behind this step's samples,
    summed over the engines (in parallel on several workers, so the wall time is less);
    what the stage-time bound of ``python -m rlwire.trainer.bench`` divides over them."""
    turns_mean: float | None = None
    """Multi-turn rollouts: model turns per trajectory (mean)."""
    tool_calls_mean: float | None = None
    """Multi-turn rollouts: tool calls run per trajectory (mean)."""
    tool_errors: float | None = None
    """Multi-turn rollouts: calls that failed (unparsable, unknown tool, bad arguments, raised,
    returned no text, past ``agent.tool_timeout``) and environment steps that failed."""
    tool_calls_dropped: float | None = None
    """Multi-turn rollouts: calls beyond ``agent.max_parallel_calls`` in one message."""
    tool_time_s: float | None = None
    """Multi-turn rollouts: mean seconds per tool call."""
    trajectory_length: float | None = None
    """Multi-turn rollouts: mean response tokens per trajectory, the environment's and the
    chat template's included (``response_length`` counts the model's)."""
    model_calls_mean: float | None = None
    """``agent.function``: calls to the model per session (mean)."""
    agent_breaks: float | None = None
    """``agent.function``: calls in the batch whose prompt did not extend the session's
    sequence before it (the agent rewrote its history); the session trains its last."""
    agent_failures: float | None = None
    """``agent.function``: sessions in the batch whose agent raised, returned no finite
    reward, made no call or ran past ``agent.timeout`` (reward 0; each named in the rollout
    worker's log)."""
    weight_digest_actor: str | None = None
    """With ``ckpt_engine.digest`` on a sync step: the weights sent."""
    weight_digest_rollout: list[str] | None = None
    """With ``ckpt_engine.digest`` on a sync step: each rollout worker's weights."""
    weight_sync_senders: int | None = None
    """On a sync step: the actor ranks that sent (1: rank 0 alone; ``ckpt_engine.per_rank``:
    every rank with rollout engines of its own, at once)."""
    weight_sources: list[list[int]] | None = None
    """With ``ckpt_engine.digest`` over ``shm``, on a sync step: for each rollout worker, the
    actor ranks whose shared memory it maps (read from the kernel's maps of its process):
    which rank each engine received from."""

    def to_json(self) -> dict[str, Any]:
        """The line written to ``metrics.jsonl`` (step first, no ``None``, no ``tokens``;
        then verl's and TRL's names for the metrics they share: :mod:`.metric_names`)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.pop("tokens")
        extra = values.pop("reward_extra")
        line = {"step": values.pop("step")}
        line.update({f"reward_extra/{k}": v for k, v in extra.items()})
        line.update({k: v for k, v in values.items() if v is not None})
        return with_aliases(line)


# What the actor ranks report and the step records as their mean.
_SLOWEST_RANK = (  # phase times: the update waits for the slowest actor rank
    "time_old_logprob_s",
    "time_ref_s",
    "time_forward_backward_s",
    "time_optimizer_s",
    "time_actor_s",
)
_MEAN_OVER_RANKS = (
    "policy_loss",
    "clip_fraction",
    "entropy",
    "kl_ref",
    "grad_norm",
    "kl_rollout",
    "kl_behaviour_proximal",
    "rollout_is_mean",
    "rollout_is_truncated_fraction",
    "rollout_rs_masked_fraction",
)


def update_metrics(
    batch: Rollout,
    rewards,
    reward_extra: dict[str, float],
    reward_s: float,
    results: list[dict[str, Any]],
) -> UpdateMetrics:
    """One update's metrics: ``batch``'s scores (``rewards``, the reward's extras and the
    seconds scoring took) and the actor ranks' reports ``results``, combined (means, or the
    slowest rank's times)."""
    per_sample = batch.response_mask.sum(dim=1)
    tokens = int(per_sample.sum())
    mean = {k: sum(r[k] for r in results) / len(results) for k in _MEAN_OVER_RANKS}
    spans = batch.version_spans()
    return UpdateMetrics(
        reward_mean=rewards.mean().item(),
        reward_std=rewards.std().item(),
        reward_extra=reward_extra,
        response_length=tokens / len(batch),
        response_length_max=int(per_sample.max()),
        response_length_min=int(per_sample.min()),
        **mean,
        rollout_is_max=max(r["rollout_is_max"] for r in results),
        lr_scale=results[0]["lr_scale"],
        retained_grad_bytes=max(r["retained_grad_bytes"] for r in results),
        grad_sync_policy=results[0]["grad_sync_policy"],
        optimizer_steps=results[0]["optimizer_steps"],
        version_span_max=int(spans.max()),
        continued_fraction=float((spans > 0).float().mean()),
        tokens=tokens,
        time_reward_s=reward_s,
        **{k: max(r[k] for r in results) for k in _SLOWEST_RANK},
    )


def skipped_update_metrics(
    rewards, reward_extra: dict[str, float], reward_s: float, previous: UpdateMetrics | None
) -> UpdateMetrics:
    """The metrics of an update that did not run (no sample held a token to train on):
    the batch's scores, zero losses, times and tokens, no correction (ratios 1), and the
    learning-rate scale and gradient-sync policy of the ``previous`` update (if any)."""
    return UpdateMetrics(
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0,
        reward_extra=reward_extra,
        response_length=0.0,
        response_length_max=0,
        response_length_min=0,
        **{k: 0.0 for k in (*_MEAN_OVER_RANKS, *_SLOWEST_RANK)} | {"rollout_is_mean": 1.0},
        rollout_is_max=1.0,
        optimizer_steps=0,
        update_skipped=True,
        lr_scale=previous.lr_scale if previous is not None else 1.0,
        version_span_max=0,
        continued_fraction=0.0,
        retained_grad_bytes=0,
        grad_sync_policy=previous.grad_sync_policy if previous is not None else "none",
        tokens=0,
        time_reward_s=reward_s,
    )


def mean_lag(lags: list[int]) -> float:
    """The mean of ``lags`` (the version lag of each sample or group that holds a response
    token); 0.0 for none: a step whose every agent session failed, which trains nothing."""
    return sum(lags) / len(lags) if lags else 0.0


def step_record(
    step: int,
    result: UpdateMetrics,
    phases: tuple[float, float, float],
    synced: dict[str, Any],
    *,
    batch: Rollout,
    version: int,
    lags: list[int],
    **extra: Any,
) -> StepMetrics:
    """The metrics every mode records: ``phases`` are the driver's seconds waiting for
    the samples, for the update and for the sync (the step's time is their sum);
    ``lags`` the version lag of each sample or prompt group that holds a response token
    (none: every agent session failed, lags 0); ``batch`` what was trained;
    ``extra`` the mode's own optional fields."""
    rollout_s, update_s, sync_s = phases
    seconds = rollout_s + update_s + sync_s
    generate_s = None if batch.generate_s is None else float(batch.generate_s.sum())
    return StepMetrics(
        step=step + 1,
        **{f.name: getattr(result, f.name) for f in dataclasses.fields(UpdateMetrics)},
        time_rollout_s=rollout_s,
        time_update_s=update_s,
        time_weight_sync_s=sync_s,
        weight_sync_gbps=synced["weight_sync_gbps"],
        weight_sync_bytes=synced.get("weight_sync_bytes"),
        weight_sync_wire_bytes=synced.get("weight_sync_wire_bytes"),
        weight_sync_delta_density=synced.get("weight_sync_delta_density"),
        time_weight_export_s=synced.get("time_weight_export_s"),
        weight_sync_senders=synced.get("weight_sync_senders"),
        weight_sources=synced.get("weight_sources"),
        tokens_per_s=result.tokens / seconds,
        samples_per_s=len(batch) / seconds,
        time_generate_s=generate_s,
        weight_version=version,
        version_lag_mean=mean_lag(lags),
        version_lag_max=max(lags, default=0),
        **(_digests(synced, synced["pulls"]) if synced["pulls"] else {}),
        **_conversations(batch),
        **extra,
    )


def _conversations(batch: Rollout) -> dict[str, Any]:
    """The multi-turn metrics of ``batch`` (none for single-turn samples)."""
    if batch.trajectories is None:
        return {}
    return trajectory_metrics(batch.trajectories, response_lengths(batch.response_mask).tolist())


def _digests(push: dict, pulls: list[dict]) -> dict[str, Any]:
    if push.get("digest") is None:
        return {}
    return {
        "weight_digest_actor": push["digest"],
        "weight_digest_rollout": [p["digest"] for p in pulls],
    }
