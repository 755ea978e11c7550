"""Every engine's weights compared with the actor's after every sync (``ckpt_engine.digest``):
a run whose engine holds other weights than the actor sent stops at that sync, naming the
weight version, the rollout worker and the first tensor that differs, instead of training
on samples from the wrong policy (a LoRA adapter never delivered, weights dropped while an
engine slept, a torn transfer)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import RunError
from ..rollout.digest import first_difference

__all__ = ["WeightCheck"]

log = logging.getLogger(__name__)


class WeightCheck:
    """Compares a sync's report (the actor's ``digest`` and ``digest_parts``, and each
    engine's in ``pulls``) as each sync ends; says once when an engine gives no digest."""

    def __init__(self) -> None:
        self._said_none: set[int] = set()

    def __call__(self, report: dict[str, Any], version: int) -> None:
        """Raise RunError (one line) when an engine's digest differs from the actor's
        after the sync of ``version``; nothing without digests (``ckpt_engine.digest``
        off)."""
        sent = report.get("digest")
        if sent is None:
            return
        for position, pull in enumerate(report.get("pulls", [])):
            worker = pull.get("worker", position)
            held = pull.get("digest")
            if held is None:
                if worker not in self._said_none:
                    self._said_none.add(worker)
                    log.warning(
                        "ckpt_engine.digest: rollout worker %s's engine gives no digest of "
                        "its weights; its updates are not compared",
                        worker,
                    )
                continue
            if held == sent:
                continue
            ours, theirs = report.get("digest_parts"), pull.get("digest_parts")
            if ours is not None and theirs is not None:
                name = first_difference(ours, theirs)
                where = f"first differing tensor: {name}" if name else "no tensor differs"
            else:
                where = "the engine gives no per-tensor digests to name a tensor"
            raise RunError(
                f"ckpt_engine.digest: after the sync of weight version {version}, rollout "
                f"worker {worker}'s engine holds other weights than the actor sent "
                f"(digest {held[:12]} against {sent[:12]}; {where})"
            )
