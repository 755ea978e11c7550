"""What a run reads: the data files and built-in tasks, rewards, validation, and the model
and checkpoints a run starts from; ``config.py`` holds the data, validation and reward
sections of the configuration (it imports nothing else from here).

Imports ``algorithms``, ``agent``, ``rollout``, ``models`` and the foundation."""
