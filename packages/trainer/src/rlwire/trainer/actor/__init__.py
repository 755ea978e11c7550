"""Actor engines: one module per kind (``fsdp``: FSDP2 and FSDP1; ``megatron``), one seam.

Add an engine by subclassing :class:`ActorEngine` in a module of its own and naming it in
:data:`ACTOR_ENGINES`, or, outside this package, with ``actor.strategy=pkg.module:Class``.
Imports ``algorithms`` (the update), ``models`` and the foundation; no Ray, no job.
"""

from __future__ import annotations

from .base import ACTOR_ENGINES, ActorEngine, actor_engine_class

__all__ = ["ACTOR_ENGINES", "ActorEngine", "actor_engine_class"]
