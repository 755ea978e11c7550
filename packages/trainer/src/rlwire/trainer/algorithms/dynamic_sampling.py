"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): prompt groups whose rewards
are all equal give GRPO-style estimators no signal (every advantage 0), so they are dropped
and generation goes on, with the same weights, over the next prompts of the data until the
batch has ``data.train_batch_size`` groups whose ``metric`` differs (the reward, or a
per-sample extra of the reward function such as the DAPO recipe's ``acc``); groups beyond
that are discarded (as verl does). Each extra generation batch moves the data position on
by one batch, and checkpoints keep it.
"""

from __future__ import annotations

import dataclasses

import torch

from ..checks import check

__all__ = ["FilterGroupsConfig", "varied_groups"]


@dataclasses.dataclass(kw_only=True, slots=True)
class FilterGroupsConfig:
    enable: bool = False
    """Drop prompt groups whose ``metric`` is the same for every sample and generate more
    until the batch is full (colocated mode)."""
    metric: str = "reward"
    """What must differ within a group: ``reward`` (the reward after shaping), or the name
    of a numeric entry of the dict a per-sample reward function returns (the DAPO recipe's
    ``acc``), compared per sample. A name the reward does not return stops the run at the
    first scored batch, listing the names it did return."""
    max_num_gen_batches: int = 0
    """Generation batches at most per step (the first included); the run stops with a line
    saying so when they do not fill the batch. 0: no limit."""

    def __post_init__(self) -> None:
        check(
            isinstance(self.metric, str) and self.metric.isidentifier(),
            "algorithm.filter_groups.metric",
            self.metric,
            "use 'reward' or the name of an extra the reward function returns (an identifier "
            "such as 'acc')",
        )
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
