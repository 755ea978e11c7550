"""What a run reads: the data files and built-in tasks, rewards, validation, and the model
and checkpoints a run starts from.

Imports ``algorithms``, ``agent``, ``rollout``, ``models`` and the foundation."""
