"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): prompt groups whose rewards
are all equal give GRPO-style estimators no signal (every advantage 0), so they are dropped
and generation goes on, with the same weights, over the next prompts of the data until the
batch has ``data.train_batch_size`` groups with differing rewards; groups beyond that are
discarded (as verl does). Each extra generation batch moves the data position on by one
batch, and checkpoints keep it.
"""

from __future__ import annotations

import dataclasses

import torch

from .checks import check, check_choice

__all__ = ["FilterGroupsConfig", "varied_groups"]


@dataclasses.dataclass(kw_only=True, slots=True)
class FilterGroupsConfig:
    enable: bool = False
    """Drop prompt groups whose ``metric`` is the same for every sample and generate more
    until the batch is full (colocated mode)."""
    metric: str = "reward"
    """What must differ within a group: ``reward`` (the reward after shaping: verl's
    canonical one). verl's other names pick a per-sample entry of the reward's extras,
    which rlwire-train averages over the batch instead of keeping: not offered."""
    max_num_gen_batches: int = 0
    """Generation batches at most per step (the first included); the run stops with a line
    saying so when they do not fill the batch. 0: no limit."""

    def __post_init__(self) -> None:
        check_choice(self.metric, "algorithm.filter_groups.metric", ("reward",))
        check(
            self.max_num_gen_batches >= 0,
            "algorithm.filter_groups.max_num_gen_batches",
            self.max_num_gen_batches,
            "use an int >= 0 (0: no limit)",
        )


def varied_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(G,)`` bool: the groups of ``group_size`` consecutive ``values`` that are not all
    equal (verl keeps a group whose standard deviation is above 0, or a group of one)."""
    grouped = values.view(-1, group_size)
    if group_size == 1:
        return torch.ones(grouped.shape[0], dtype=torch.bool)
    return grouped.std(dim=1) > 0
