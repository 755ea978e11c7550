"""The processes: the Ray cluster, the actor and rollout workers (and the hybrid one), the
background weight sender, who sends the weights to whom (``senders``), validation's
scheduling, and the job that holds them.

Imports ``config`` and everything below it; never ``modes`` or ``tools``."""
