"""Steps with nothing to train on: every agent session of the step failed before the model
answered, so no sample holds a response token. Such a step is skipped (no update runs; its
metrics line says ``update_skipped``) and counted; ``agent.max_failed_steps`` of them in a
row stop the run in one line naming the agent and its last error."""

from __future__ import annotations

import logging

from ..algorithms.scoring import Scored
from ..errors import RunError
from ..outputs.metrics import UpdateMetrics, skipped_update_metrics
from ..rollout import Rollout

__all__ = ["SkippedSteps"]

log = logging.getLogger("rlwire.trainer")


class SkippedSteps:
    """The count of steps skipped in a row, for ``agent`` (the run's ``agent`` section)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.in_a_row = 0
        self.last: UpdateMetrics | None = None
        """The last update that ran (its learning-rate scale and sync policy carry over)."""

    def trained(self, metrics: UpdateMetrics | None = None) -> None:
        """An update runs (``metrics``: its, once known): the count starts again."""
        self.in_a_row = 0
        if metrics is not None:
            self.last = metrics

    def skip(self, batch: Rollout, scored: Scored) -> UpdateMetrics:
        """The metrics of ``batch``'s step, skipped; or RunError once
        ``agent.max_failed_steps`` steps in a row were."""
        self.in_a_row += 1
        errors = [t.error for t in batch.trajectories or () if t.error]
        last = errors[-1] if errors else "no sample holds a response token"
        agent = self.agent
        who = f"agent.function {agent.function!r}" if agent.function else "the agent"
        if self.in_a_row >= agent.max_failed_steps:
            raise RunError(
                f"{who}: every session failed in {self.in_a_row} steps in a row "
                f"(agent.max_failed_steps); the last: {last}"
            )
        log.warning("%s: every session of this step failed (the last: %s); skipped", who, last)
        return skipped_update_metrics(scored.rewards, scored.extra, scored.seconds, self.last)
