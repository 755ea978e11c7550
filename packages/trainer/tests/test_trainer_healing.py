"""Rollout workers that heal (:mod:`rlwire.trainer.runtime.healing`): the restart policy and
the fleet's metrics, without Ray (the jobs that kill a worker are in
``test_trainer_one_step_off.py`` and ``test_trainer_fully_async.py``)."""

from __future__ import annotations

import types

import pytest

from rlwire.trainer.config.root import load_config
from rlwire.trainer.errors import RunError
from rlwire.trainer.runtime import healing
from rlwire.trainer.runtime.waits import RolloutLost


def _fleet(*overrides: str, hybrid: bool = False) -> tuple[healing.Fleet, list[int]]:
    """A fleet over a stand-in job of 2 rollout workers; the indices it started are listed
    (starting a replacement needs Ray: :meth:`Fleet._start` is replaced)."""
    config = load_config(overrides=["rollout.num_workers=2", *overrides])
    job = types.SimpleNamespace(config=config, hybrid=hybrid, rollouts=["w0", "w1"])
    fleet = healing.Fleet(job, make=lambda index, restart: f"w{index}r{restart}")
    started: list[int] = []
    fleet._start = lambda index: (started.append(index), fleet.joining.add(index))
    return fleet, started


def _lost(index: int) -> RolloutLost:
    return RolloutLost(f"generation: rollout worker {index} died (ActorDiedError: gone)", index)


def test_a_worker_that_keeps_dying_stops_the_run_with_its_line(monkeypatch):
    fleet, started = _fleet(
        "trainer.mode=one_step_off", "rollout.max_restarts=2", "rollout.restart_window_s=60"
    )
    clock = [1000.0]
    monkeypatch.setattr(healing.time, "monotonic", lambda: clock[0])
    fleet.replace(_lost(1))
    fleet.replace(_lost(0))  # another worker's restarts are its own
    clock[0] += 30
    fleet.replace(_lost(1))
    with pytest.raises(RunError) as stop:
        fleet.replace(_lost(1))  # a third within 60 s
    assert str(stop.value) == (
        "generation: rollout worker 1 died (ActorDiedError: gone) (rollout worker 1 was "
        "replaced 2 times within 60 s: rollout.max_restarts, rollout.restart_window_s)"
    )
    clock[0] += 31  # the first of worker 1's restarts left the window
    fleet.replace(_lost(1))
    assert started == [1, 0, 1, 1] and fleet.total == 4
    assert fleet.record() == {"rollout_restarts": 4, "rollout_engines_live": 0}


@pytest.mark.parametrize(
    ("overrides", "hybrid"),
    [
        (("trainer.mode=one_step_off", "rollout.max_restarts=0"), False),
        (("trainer.mode=colocated",), True),  # the engines live in the actor ranks
    ],
)
def test_a_death_the_fleet_does_not_heal_is_the_line_it_always_was(overrides, hybrid):
    fleet, started = _fleet(*overrides, hybrid=hybrid)
    lost = _lost(0)
    with pytest.raises(RolloutLost) as stop:
        fleet.replace(lost)
    assert stop.value is lost and started == [] and not fleet.heals


def test_regenerated_groups_are_counted_once_per_step_and_named(capsys):
    fleet, _ = _fleet("trainer.mode=one_step_off")
    fleet.regenerating(1, range(4, 8), 0, position=3)
    fleet.requeued(1, [12, 13])
    assert fleet.record()["regenerated_groups"] == 6
    assert "regenerated_groups" not in fleet.record()  # the next step's: none
    err = capsys.readouterr().err
    assert (
        "the 4 prompt groups rollout worker 1 was generating (batch 3, prompts 4-7) are "
        "generated again by rollout worker 0" in err
    )
    assert "(data positions 12, 13) go back to be generated first" in err


def test_restart_settings_are_checked():
    from rlwire.trainer.config.root import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.max_restarts: -1 .*use an int >= 0"):
        load_config(overrides=["rollout.max_restarts=-1"])
    with pytest.raises(ConfigError, match=r"rollout.restart_window_s: 0.*use seconds > 0"):
        load_config(overrides=["rollout.restart_window_s=0"])
