"""What a run writes: checkpoints (and reading them back safely), metrics and loggers, the
rollout data dumps, the plot and the closing summary.

Imports ``data``, ``agent``, ``rollout`` and the foundation."""
