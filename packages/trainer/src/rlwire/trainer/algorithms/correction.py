"""Off-policy correction: importance weights from the behaviour policy to the proximal one.

Three log-probabilities of every sampled token meet in the loss:

- *behaviour* (``Rollout.logprobs``): the policy that generated the token, as the rollout
  engine computed it (an older version in fully-async mode, other numerics with vLLM);
- *proximal*: the actor's log-probs before this update (forward only), the anchor PPO
  clips against (AReaL's decoupled PPO; verl's ``old_log_prob``);
- the current policy being trained.

With ``rho = pi_proximal / pi_behaviour`` (per token, or per sequence as the product over
its tokens), verl's ``algorithm.rollout_correction`` settings mean:

- ``rollout_is`` (``token`` / ``sequence`` / null): truncated importance sampling, every
  token's loss term weighted by ``min(rho, rollout_is_threshold)`` (detached). Over the
  PPO loss against the proximal policy this *is* decoupled PPO;
- ``rollout_rs`` (``token`` / ``sequence`` / null): masked importance sampling (rejection),
  tokens or whole sequences whose ``rho`` leaves ``[rollout_rs_threshold_lower,
  rollout_rs_threshold]`` leave the loss;
- ``bypass_mode``: no proximal forward pass; the behaviour log-probs are the anchor
  (``rho`` is then 1 and PPO's clip is the only correction).

With behaviour = proximal every ``rho`` is exactly 1: the weights are 1 and nothing is
masked, so every setting gives the uncorrected loss bit for bit.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from .losses import k3_kl

__all__ = ["Correction", "GapWatch", "RolloutCorrectionConfig", "correction_weights"]

_LEVELS = ("token", "sequence")
_LOG_RATIO_BOUND = 20.0  # exp(+-20): weights stay finite whatever the log-probs say


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``, with its key names and meanings."""

    rollout_is: str | None = "auto"
    """Truncated importance sampling: ``token``, ``sequence``, null (off) or ``auto``
    (``token`` in the off-policy modes, ``one_step_off`` and ``fully_async``; off in
    colocated mode; the metrics are logged either way, so a mismatch between the rollout
    engine and the actor shows)."""
    rollout_is_threshold: float = 2.0
    """``C``: importance weights are truncated to at most this."""
    rollout_rs: str | None = None
    """Masked importance sampling (rejection): ``token``, ``sequence`` or null (off)."""
    rollout_rs_threshold: float = 2.0
    """Upper bound of the kept weights' range."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the kept weights' range (null: ``1 / rollout_rs_threshold``)."""
    bypass_mode: bool = False
    """True: skip the proximal forward pass and clip against the behaviour log-probs
    (every ``rho`` is then 1, so ``rollout_rs`` is refused with it)."""
    warn_truncated_fraction: float | None = 0.05
    """rlwire's own: say so once, in one warning line with the measured
    ``kl_behaviour_proximal``, when the mean ``rollout_is_truncated_fraction`` of the last
    10 steps passes this: the off-policy gap has outgrown what truncation at
    ``rollout_is_threshold`` corrects, and the run learns from samples the loss no longer
    weighs right (a smaller ``async.staleness_threshold`` or learning rate narrows it).
    null: never."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for key, allowed in (("rollout_is", (*_LEVELS, "auto")), ("rollout_rs", _LEVELS)):
            value = getattr(self, key)
            if value is not None and value not in allowed:
                listed = ", ".join(repr(a) for a in allowed)
                raise ValueError(f"{name}.{key}: {value!r} is not allowed; use {listed} or null")
        for key in ("rollout_is_threshold", "rollout_rs_threshold"):
            if not getattr(self, key) >= 1:
                raise ValueError(
                    f"{name}.{key}: {getattr(self, key)!r} is not allowed; use a float >= 1"
                )
        warn = self.warn_truncated_fraction
        if warn is not None and not 0 < warn <= 1:
            raise ValueError(
                f"{name}.warn_truncated_fraction: {warn!r} is not allowed; "
                "use a float in (0, 1] or null"
            )
        lower = self.rollout_rs_threshold_lower
        if lower is not None and not 0 < lower <= 1:
            raise ValueError(
                f"{name}.rollout_rs_threshold_lower: {lower!r} is not allowed; "
                "use a float in (0, 1] or null"
            )
        if self.bypass_mode and self.rollout_rs is not None:
            raise ValueError(
                f"{name}.rollout_rs: {self.rollout_rs!r} cannot act with "
                f"{name}.bypass_mode=true (the behaviour log-probs are the proximal ones, "
                "so every ratio is 1 and nothing is rejected); "
                "set bypass_mode=false or rollout_rs=null"
            )

    def is_level(self, off_policy: bool) -> str | None:
        """The truncated-IS level in effect (``auto`` resolved for the mode)."""
        if self.rollout_is == "auto":
            return "token" if off_policy else None
        return self.rollout_is

    def rs_bounds(self) -> tuple[float, float]:
        upper = self.rollout_rs_threshold
        lower = self.rollout_rs_threshold_lower
        return (1.0 / upper if lower is None else lower), upper


class GapWatch:
    """Watches the steps' correction metrics for an off-policy gap the correction cannot
    hold (``warn_truncated_fraction``); :meth:`observe` returns the one warning, once."""

    WINDOW = 10

    def __init__(self, config: RolloutCorrectionConfig) -> None:
        self.limit = config.warn_truncated_fraction
        self.threshold = config.rollout_is_threshold
        self.recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.WINDOW)
        self.warned = False

    def observe(self, step: int, truncated: float, kl: float) -> str | None:
        """Step ``step``'s ``rollout_is_truncated_fraction`` and ``kl_behaviour_proximal``;
        the warning the first time the window's mean passes the limit, else None."""
        self.recent.append((truncated, kl))
        if self.warned or self.limit is None or len(self.recent) < self.WINDOW:
            return None
        mean_truncated = sum(t for t, _ in self.recent) / self.WINDOW
        if mean_truncated <= self.limit:
            return None
        self.warned = True
        mean_kl = sum(k for _, k in self.recent) / self.WINDOW
        return (
            f"off-policy gap past what the correction holds at step {step}: "
            f"{mean_truncated:.1%} of tokens' importance weights truncated at "
            f"{self.threshold:g} (mean of the last {self.WINDOW} steps; "
            f"algorithm.rollout_correction.warn_truncated_fraction={self.limit:g}), "
            f"kl_behaviour_proximal {mean_kl:.4f} per token; lower async.staleness_threshold "
            "or the learning rate"
        )


@dataclasses.dataclass(slots=True)
class Correction:
    """The correction of one batch: loss weights and mask, and what to log."""

    weights: torch.Tensor
    """``(B, T)`` float32 factor on each token's loss term (1 where uncorrected)."""
    mask: torch.Tensor
    """``(B, T)`` the response mask with rejected tokens zeroed."""
    metrics: dict[str, float]
    """``rollout_is_mean`` / ``rollout_is_max`` (``rho`` over real tokens, or over
    sequences at sequence level, before truncation), ``rollout_is_truncated_fraction``,
    ``rollout_rs_masked_fraction`` (of real tokens) and ``kl_behaviour_proximal`` (k3)."""


def correction_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    off_policy: bool,
) -> Correction:
    """The importance weights and rejection mask for ``(B, T)`` log-probs (see the module)."""
    real = mask.to(torch.float32)
    tokens = real.sum().clamp(min=1)
    log_rho = ((proximal - behaviour).float() * real).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    seq_log_rho = log_rho.sum(dim=1).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)

    def per_level(level: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``rho`` broadcast over tokens, and the units it is counted over (``(B, T)``)."""
        if level == "sequence":
            rho = seq_log_rho.exp().unsqueeze(1).expand_as(real)
            units = torch.zeros_like(real)
            units[:, 0] = 1.0  # one unit per sequence
            return rho, units
        return log_rho.exp(), real

    level = config.is_level(off_policy)
    rho, units = per_level(level)
    count = units.sum().clamp(min=1)
    threshold = config.rollout_is_threshold
    truncated = ((rho > threshold).float() * units).sum() / count
    weights = torch.clamp(rho, max=threshold) if level is not None else torch.ones_like(rho)
    keep = real
    if config.rollout_rs is not None:
        lower, upper = config.rs_bounds()
        rs_rho, _ = per_level(config.rollout_rs)
        keep = real * ((rs_rho >= lower) & (rs_rho <= upper)).float()
    masked = 1.0 - keep.sum() / tokens
    metrics = {
        "rollout_is_mean": float((rho * units).sum() / count),
        "rollout_is_max": float(torch.where(units > 0, rho, 0.0).max()) if units.any() else 1.0,
        "rollout_is_truncated_fraction": float(truncated) if level is not None else 0.0,
        "rollout_rs_masked_fraction": float(masked),
        "kl_behaviour_proximal": float(
            (k3_kl(behaviour.float(), proximal.float()) * real).sum() / tokens
        ),
    }
    return Correction(weights.detach(), keep.to(mask.dtype), metrics)
