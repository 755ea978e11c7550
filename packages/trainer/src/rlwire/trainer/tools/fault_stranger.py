"""The fault campaign's stranger (:mod:`rlwire.trainer.tools.faults`, ``--special stranger``):
a process that can reach the checkpoint engine's store but was never given the group's
secret writes bucket metadata the rollout workers would act on. The run must stop with one
line naming the refused message (the update aborted, the previous weights kept), and the
same command without the stranger must resume and complete.

The store's address is the one the driver logs (``checkpoint engine master at HOST:PORT``
in ``train.log``); the stranger writes ``meta/<seq>`` for the next buckets, as unsigned
:class:`rlwire.ckpt_engine` bucket metadata, so the first bucket a receiver reads after
that is the stranger's."""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable
from typing import Any

from .fault_runs import Trial, Watched

__all__ = ["stranger_between", "stranger_fault", "stranger_verdict"]

AHEAD = 2000
"""Bucket sequence numbers written ahead (a sync of the tiny job is a few buckets)."""

_MASTER = re.compile(r"checkpoint engine master at (\S+):(\d+)")


def stranger_fault(trial: Trial, env: dict[str, str]) -> Callable[[Watched], dict | None]:
    def fault(run: Watched) -> dict | None:
        log = run.run_dir / "train.log"
        found = _MASTER.search(log.read_text(errors="replace")) if log.exists() else None
        if found is None:
            return None
        import torch.distributed as dist

        from rlwire.ckpt_engine._wire import BucketMeta

        host, port = found.group(1), int(found.group(2))
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
        for seq in range(AHEAD):  # unsigned: no tag, as a process without the secret writes
            forged = BucketMeta(index=seq, version=10**6, nbytes=0, entries=[], last=True)
            store.set(f"meta/{seq}", forged.to_bytes())  # type: ignore[arg-type]  # stub: str only
        return {"at": time.time(), "monotonic": time.monotonic(), "existed": True}

    return fault


def stranger_between(trial: Trial, run: Watched, digests: dict) -> dict[str, Any]:
    text = (run.run_dir / "train.log").read_text(errors="replace")
    return {"landed": bool(_MASTER.search(text))}


def stranger_verdict(r: dict[str, Any]) -> dict[str, Any]:
    named = "fails authentication" in r["stop_line"] and "meta/" in r["stop_line"]
    return {
        "special_failures": {
            "stranger: the store's address was never logged": not r["landed"],
            "stranger: the first run did not stop": r["rc1"] == 0,
            "stranger: the stop line does not name the refused message": not named,
        }
    }
