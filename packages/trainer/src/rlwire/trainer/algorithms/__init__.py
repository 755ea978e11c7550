"""The algorithm: advantages, losses, off-policy correction, KL in the reward, shaping,
scoring and dynamic sampling, and one actor update over micro-batches.

Imports ``rollout`` (the batch types), ``models`` and the foundation; no process, no Ray."""
