"""Waits on a whole weight transfer in fully-async mode: bounded by the time without
progress, not by the transfer's total (the checkpoint engine bounds each of its waits by
``ckpt_engine.timeout``; a large model's transfer takes longer in all); and an update staged
from a group that was left is dropped when a re-formed one is joined. Unit level: a stand-in
rollout engine whose staging reports progress as the real receivers do (``progressed_at``)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest

from rlwire.trainer.config.root import load_config
from rlwire.trainer.runtime import weight_push, weight_stage
from rlwire.trainer.runtime.background import Background
from rlwire.trainer.runtime.rollout_worker import RolloutWorker

TICK_S = 0.1  # progress this often ...
IDLE_S = 1.0  # ... within a budget of this much without progress ...
TICKS = 16  # ... over 1.6 s in all: more than the budget


class _Handle:
    """The receiver's handle a rollout engine's join() returns: when it last moved."""

    def __init__(self) -> None:
        self.progressed_at = time.monotonic()


class _Staging:
    """A rollout engine that stages: receives in ``ticks`` steps (progress after each),
    then ``stall`` seconds without progress; its commit holds ``version``."""

    stages_updates = True

    def __init__(self, version: int, ticks: int = TICKS, stall: float = 0.0) -> None:
        self.version, self.ticks, self.stall, self.joined = version, ticks, stall, 0

    def join(self, backend, *, rank, world_size, metadata) -> _Handle:
        self.joined += 1
        return _Handle()

    async def stage(self, engine: _Handle):
        for _ in range(self.ticks):
            await asyncio.sleep(TICK_S)
            engine.progressed_at = time.monotonic()
        await asyncio.sleep(self.stall)
        return lambda: self.version

    def between_steps(self, fn):
        return fn()


@pytest.fixture
def worker(monkeypatch) -> RolloutWorker:
    # one budget for the test, without the 30 s margin of the real one
    monkeypatch.setattr(weight_stage, "idle_budget", lambda timeout: timeout, raising=False)
    config = load_config(overrides=["ckpt_engine.digest=false"])
    config = dataclasses.replace(
        config, ckpt_engine=dataclasses.replace(config.ckpt_engine, timeout=IDLE_S)
    )
    w = RolloutWorker(config, "unused", index=3)
    w.backend = _Staging(7)  # type: ignore[assignment]  # the stand-in engine
    w.engine_init("gloo", world_size=2, metadata={})
    return w


def _stage_in_background(w: RolloutWorker, version: int) -> threading.Thread:
    thread = threading.Thread(target=w.stage_weights, args=(version,), daemon=True)
    thread.start()
    return thread


def test_a_receive_longer_than_the_budget_that_moves_is_taken(worker):
    staging = _stage_in_background(worker, 7)
    # sync's wait, with ckpt_engine.timeout (before: a 1 s bound on the whole receive)
    taken = worker._take_staged(7, IDLE_S)
    # generation stopped only for the commit, which here takes no part of the slow receive
    assert taken.pop("commit_s") < IDLE_S
    assert taken == {"version": 7, "worker": worker.index, "digest": None}
    staging.join(timeout=30)
    assert not staging.is_alive()


def test_a_receive_that_stops_moving_fails_naming_the_worker_and_the_setting(worker):
    worker.backend = _Staging(7, ticks=2, stall=3 * IDLE_S)  # type: ignore[assignment]
    staging = _stage_in_background(worker, 7)
    with pytest.raises(
        TimeoutError,
        match=r"rollout worker 3: weights 7: the receive made no progress for 1 s .*"
        r"ckpt_engine.timeout=1 s per wait",
    ):
        worker.sync(7)
    staging.join(timeout=30)


def test_an_update_staged_from_the_old_group_is_dropped_when_a_new_one_is_joined(worker):
    worker.backend = _Staging(7, ticks=1)  # type: ignore[assignment]
    assert worker.stage_weights(7)  # received; the run's sync never comes (the group is lost)
    worker.engine_init("gloo", world_size=2, metadata={})  # the re-formed group
    worker.backend = _Staging(8, ticks=1)  # type: ignore[assignment]
    # before: "version 8 arrived before the previous update was written in"
    assert worker.stage_weights(8)
    assert worker.sync(8)["version"] == 8


class _Sender:
    """Rank 0's checkpoint engine as finish_push sees it: when its send last moved."""

    def __init__(self) -> None:
        self.progressed_at = time.monotonic()


def _pusher(monkeypatch, ticks: int, stall: float):
    monkeypatch.setattr(weight_push, "idle_budget", lambda timeout: timeout, raising=False)
    push = weight_push.WeightPush()
    push.config = SimpleNamespace(ckpt_engine=SimpleNamespace(timeout=IDLE_S))  # type: ignore[assignment]
    push.engine = sender = _Sender()  # type: ignore[assignment]
    push._sending = Background("actor rank 0's weight send")

    async def send() -> dict:
        for _ in range(ticks):
            await asyncio.sleep(TICK_S)
            sender.progressed_at = time.monotonic()
        await asyncio.sleep(stall)
        return {"weight_sync_s": 1.0}

    push._sending.start(send, timeout=1)
    return push


def test_rank_0s_send_longer_than_the_budget_that_moves_is_finished(monkeypatch):
    assert _pusher(monkeypatch, TICKS, 0.0).finish_push() == {"weight_sync_s": 1.0}


def test_rank_0s_send_that_stops_moving_fails_naming_it_and_the_setting(monkeypatch):
    push = _pusher(monkeypatch, 2, 3 * IDLE_S)
    with pytest.raises(
        TimeoutError,
        match=r"actor rank 0's weight send: made no progress for 1 s \(ckpt_engine.timeout=1 s",
    ):
        push.finish_push()
    # still its own: a later wait takes it
    assert push._sending.finish(timeout=30) == {"weight_sync_s": 1.0}
