"""Reward shaping applied after the reward function: DAPO's overlong buffer (verl's ``dapo``
reward manager's ``overlong_buffer_cfg``).

A response longer than ``rollout.max_new_tokens - len`` tokens loses
``(length - (max_new_tokens - len)) / len x penalty_factor`` of reward, growing linearly to
``penalty_factor`` at the longest response; shorter ones are untouched. Responses cut off
at the limit are so discouraged gradually rather than all at once.
"""

from __future__ import annotations

import dataclasses

import torch

from ..checks import check

__all__ = ["OverlongBufferConfig", "overlong_penalty"]


@dataclasses.dataclass(kw_only=True, slots=True)
class OverlongBufferConfig:
    enable: bool = False
    """Penalise responses that reach into the last ``len`` tokens of
    ``rollout.max_new_tokens`` (verl's ``reward.reward_kwargs.overlong_buffer_cfg``; the DAPO
    recipe's ``reward_model.overlong_buffer``)."""
    len: int = 16
    """The buffer: how many of the last allowed tokens are penalised."""
    penalty_factor: float = 1.0
    """The penalty at the longest response (linear from 0 at the buffer's start)."""

    def __post_init__(self) -> None:
        check(self.len >= 1, "reward.overlong_buffer.len", self.len, "use an int >= 1")
        check(
            self.penalty_factor >= 0,
            "reward.overlong_buffer.penalty_factor",
            self.penalty_factor,
            "use a float >= 0",
        )


def overlong_penalty(
    lengths: torch.Tensor, max_new_tokens: int, config: OverlongBufferConfig
) -> torch.Tensor:
    """``(B,)`` penalties (0 or negative) for responses of ``lengths`` tokens."""
    if config.len > max_new_tokens:
        raise ValueError(
            f"reward.overlong_buffer.len: {config.len} is more than rollout.max_new_tokens "
            f"({max_new_tokens}); use at most that"
        )
    exceed = lengths.float() - (max_new_tokens - config.len)
    return torch.clamp(-exceed / config.len * config.penalty_factor, max=0.0)
