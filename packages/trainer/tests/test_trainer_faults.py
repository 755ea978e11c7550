"""The fault campaign's checks on hand-built inputs (no runs): each one flags a tampered
input, and passes a sound one."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlwire.trainer.tools import fault_checks as checks
from rlwire.trainer.tools import fault_hooks, fault_model
from rlwire.trainer.tools.fault_runs import Trial
from rlwire.trainer.tools.fault_specials import SPECIALS
from rlwire.trainer.tools.faults import MODES, PHASES, SIGNALS, TARGETS, failures, plan


def steps_of(groups: list[list[int]]) -> list[tuple[int, list[int]]]:
    return [(i + 1, g) for i, g in enumerate(groups)]


def test_one_step_off_accounting_flags_a_batch_trained_twice_and_one_skipped():
    sound = steps_of([[0, 1], [2, 3], [4, 5]])
    assert checks.accounting(sound, steps=3, batch_size=2) == {
        "lost": 0,
        "repeated": 0,
        "missing_steps": 0,
        "extra_steps": 0,
    }
    # a resume that went on from the wrong batch: step 2 trains batch 0 again, batch 1 is lost
    tampered = steps_of([[0, 1], [0, 1], [4, 5]])
    assert checks.accounting(tampered, steps=3, batch_size=2)["lost"] == 2
    assert checks.accounting(tampered, steps=3, batch_size=2)["repeated"] == 2
    # a step line written twice (metrics not cut back on resume), another missing
    doubled = [(1, [0, 1]), (2, [2, 3]), (2, [2, 3])]
    counted = checks.accounting(doubled, steps=3, batch_size=2)
    assert (counted["repeated"], counted["missing_steps"], counted["extra_steps"]) == (2, 1, 1)


def test_fully_async_accounting_counts_pending_groups():
    trained = steps_of([[0, 2], [1, 4]])
    # started 6: 0-2 and 4 trained, 3 and 5 pending in the checkpoint (3 dropped for its
    # lag: its position went back to be generated again, as the queue does)
    sound = checks.accounting(trained, steps=2, batch_size=2, pending=[3, 5], started=6)
    assert sound["lost"] == 0 and sound["repeated"] == 0
    lost = checks.accounting(trained, steps=2, batch_size=2, pending=[5], started=6)
    assert lost["lost"] == 1  # 3 neither trained nor pending
    # a pending group that was already trained would be trained twice on a resume
    again = checks.accounting(trained, steps=2, batch_size=2, pending=[3, 4, 5], started=6)
    assert again["repeated"] == 1 and again["lost"] == 0


def test_a_tampered_metrics_file_is_flagged(tmp_path):
    lines = [
        {"step": 1, "weight_version": 1, "group_indices": [0, 1]},
        {"step": 1, "val/reward_mean": 0.5},  # a validation line: not a step record
        {"step": 2, "weight_version": 2, "group_indices": [2, 3]},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = checks.step_records(path)
    trained = [(r["step"], r["group_indices"]) for r in records]
    assert checks.accounting(trained, steps=2, batch_size=2, started=4)["lost"] == 0
    lines[2]["group_indices"] = [1, 3]  # group 1 trained twice, group 2 never
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trained = [(r["step"], r["group_indices"]) for r in checks.step_records(path)]
    counted = checks.accounting(trained, steps=2, batch_size=2, started=4)
    assert (counted["lost"], counted["repeated"]) == (1, 1)


def test_prompts_give_one_step_off_its_groups_and_catch_a_wrong_batch():
    data = {b: [f"p{b}.{i}" for i in range(2)] for b in range(6)}
    prompts = [(1, data[0]), (2, data[1]), (3, data[1])]  # step 3 trained batch 1 again
    found = checks.indices_from_prompts(prompts, data.__getitem__, 6)
    assert found == [(1, [0, 1]), (2, [2, 3]), (3, [2, 3])]
    counted = checks.accounting(found, steps=3, batch_size=2)
    assert (counted["lost"], counted["repeated"]) == (2, 2)
    strange = checks.indices_from_prompts([(1, ["not", "data"])], data.__getitem__, 6)
    assert strange == [(1, [])]


def test_prompt_mismatches_compare_each_group_with_the_data_at_its_index():
    data = [f"p{i}" for i in range(8)]
    trained = [(1, [0, 5]), (2, [1, 2])]
    assert (
        checks.prompt_mismatches(trained, {1: ["p0", "p5"], 2: ["p1", "p2"]}, data.__getitem__) == 0
    )
    assert (
        checks.prompt_mismatches(trained, {1: ["p0", "p4"], 2: ["p1", "p2"]}, data.__getitem__) == 1
    )
    assert checks.prompt_mismatches(trained, {1: ["p0", "p5"]}, data.__getitem__) == 2


def test_versions_back_counts_a_version_below_an_earlier_one_or_past_the_step():
    records = [{"step": s, "weight_version": v} for s, v in [(1, 1), (2, 2), (3, 3)]]
    assert checks.versions_back(records) == 0
    assert checks.versions_back([*records, {"step": 4, "weight_version": 2}]) == 1
    assert checks.versions_back([{"step": 1, "weight_version": 2}]) == 1
    lagging = [{"step": s, "weight_version": v} for s, v in [(1, 0), (2, 0), (3, 2)]]
    assert checks.versions_back(lagging) == 0  # a version may stay behind, never go back


def test_digests_flag_a_changed_byte_and_accept_a_pruned_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step_{step}" / "actor").mkdir(parents=True)
        (root / f"step_{step}" / "actor" / "__0_0.distcp").write_bytes(bytes(range(256)))
        (root / f"step_{step}" / "COMPLETE").write_text(str(step))
    recorded = {p.name: checks.digest_checkpoint(p) for p in root.iterdir()}
    assert set(recorded["step_2"]) == {"COMPLETE", "actor/__0_0.distcp"}
    assert checks.damaged_files(recorded, root) == ([], [])
    data = bytearray((root / "step_4" / "actor" / "__0_0.distcp").read_bytes())
    data[100] ^= 1
    (root / "step_4" / "actor" / "__0_0.distcp").write_bytes(bytes(data))
    (root / "step_4" / "COMPLETE").unlink()
    for path in (root / "step_2").rglob("*"):
        if path.is_file():
            path.unlink()
    (root / "step_2" / "actor").rmdir()
    (root / "step_2").rmdir()
    damaged, gone = checks.damaged_files(recorded, root)
    assert damaged == ["step_4/COMPLETE", "step_4/actor/__0_0.distcp"] and gone == ["step_2"]


def test_shm_leftovers_are_the_engines_segments_of_the_runs_processes():
    from rlwire.ckpt_engine.backends._shm import SHM_PREFIX

    assert checks.SHM_PREFIX == SHM_PREFIX
    names = [
        f"{SHM_PREFIX}123-abcdef-slot0",
        f"{SHM_PREFIX}123-abcdef-arena0",
        f"{SHM_PREFIX}999-abcdef-slot0",  # another run's
        "plasma-123",
    ]
    assert checks.shm_leftovers(names, {123, 7}) == names[:2]


def test_the_plan_walks_every_combination_once_per_round():
    trials = plan(24, seed=3)
    combos = {(t.mode, t.target.rstrip("01"), t.phase) for t in trials}
    assert len(combos) == 24 == len(MODES) * len(TARGETS) * len(PHASES)
    assert plan(24, seed=3) == trials and plan(24, seed=4) != trials
    assert all(t.target in ("actor0", "actor1", "rollout0", "driver") for t in trials)
    assert [t.signal for t in trials[:6]] == ["KILL", "TERM", "STOP"] * 2 == [*SIGNALS] * 2
    # one run seed per mode (one reference run each), the trial's own seed for its fault
    assert {(t.mode, t.run_seed) for t in trials} == {("one_step_off", 3990), ("fully_async", 3991)}
    assert len({t.seed for t in trials}) == 24
    specials = [t for name in SPECIALS for t in SPECIALS[name].trials(3, 2)]
    assert {(t.mode, t.run_seed) for t in specials} <= {(t.mode, t.run_seed) for t in trials}


_SOUND = {
    "completed": True,
    "hf_model": True,
    "hang": False,
    "lost": 0,
    "repeated": 0,
    "missing_steps": 0,
    "extra_steps": 0,
    "prompt_mismatches": 0,
    "versions_back": 0,
    "shm_leftovers": 0,
    "process_leftovers": 0,
    "damaged": [],
    "clean_stop": True,
    "fault_at_s": 12.0,
    "landed": False,
}
"""A completed trial's record that passes every check."""


def test_failures_name_each_failed_check():
    sound = _SOUND
    assert failures(sound) == []
    bad = {**sound, "repeated": 8, "process_leftovers": 1, "damaged": ["step_4/COMPLETE"]}
    assert failures(bad) == ["groups repeated", "leftovers", "checkpoint damaged"]
    assert failures({**sound, "fault_at_s": None}) == ["fault never happened"]
    assert failures({**sound, "hf_model": False}) == ["completed without hf_model/"]
    differs = {**sound, "same_model": False, "model_diff": ["optimizer/state/w/exp_avg"]}
    assert failures({**differs, "exact_expected": True}) == ["model differs from its reference's"]
    assert failures({**differs, "exact_expected": False}) == []  # fully async: informational
    # no reference to compare with (its run failed) where exactness is expected: a failure
    assert failures({**sound, "same_model": None, "exact_expected": True}) == [
        "model differs from its reference's"
    ]
    # a paused process (SIGSTOP, then SIGCONT) must not stop the run: its first run exits 0
    paused = {**sound, "signal": "STOP"}
    assert failures({**paused, "rc1": 0}) == []
    assert failures({**paused, "rc1": 2}) == ["a paused process stopped the run"]


def test_summary_table_has_a_row_per_mode_fault_and_phase():
    trial = {
        "mode": "fully_async",
        "target": "driver",
        "signal": "TERM",
        "phase": "save",
        "landed": True,
        "completed": True,
        "rc1": 2,
        "lost": 0,
        "repeated": 2,
        "versions_back": 0,
        "shm_leftovers": 1,
        "process_leftovers": 0,
        "damaged": [],
        "clean_stop": True,
        "failed": ["groups repeated"],
        "seconds": 40.0,
    }
    healed = {**trial, "rc1": 0, "repeated": 0, "failed": [], "seconds": 50}
    healed.update(same_model=False, exact_expected=False)
    table = checks.summary_table([trial, healed])
    head = table.splitlines()[0]
    assert "| no restart | after restart |" in head and "| same model |" in head
    assert (
        table.splitlines()[2]
        == "| fully_async | driver TERM | save | 2 | 2 | 2 | 1 | 1 | 0 | 2 | 0 | 2 | 0 | 0/1* "
        "| 2 | 1 | 45 |"
    )
    same = {**trial, "signal": "KILL", "same_model": True, "exact_expected": True}
    assert "| driver KILL | save | 1 | 1 | 1 | 0 | 1 |" in checks.summary_table([same])
    assert "| 1/1 |" in checks.summary_table([same])


def test_the_hooks_do_nothing_when_imported_by_name():
    import builtins
    import io

    assert builtins.open is io.open and not any(
        type(f).__name__ == "_Finder" for f in sys.meta_path
    )
    assert fault_hooks._stretch_plan("actor0", "save", 2) == (False, None)


def test_the_full_disk_fails_writes_under_its_fragment_only(tmp_path):
    """The hooks as a ``sitecustomize`` in a fresh interpreter: a write under the fragment
    fails with ENOSPC (and is logged), others go through."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(Path(fault_hooks.__file__).read_text())
    events = tmp_path / "events.jsonl"
    script = (
        "import errno, pathlib, sys\n"
        f"pathlib.Path({str(tmp_path / 'ok.txt')!r}).write_text('fine')\n"
        "try:\n"
        f"    pathlib.Path({str(tmp_path / 'step_4_x.txt')!r}).write_text('lost')\n"
        "except OSError as err:\n"
        "    sys.exit(err.errno)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(hooks),
        "RLWIRE_FAULT_EVENTS": str(events),
        "RLWIRE_FAULT_ENOSPC": "step_4_",
    }
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=60)
    assert done.returncode == errno.ENOSPC
    assert (tmp_path / "ok.txt").read_text() == "fine"
    assert (tmp_path / "step_4_x.txt").read_bytes() == b""  # created, nothing written
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["ev"] for e in logged] == ["enospc"]


class _Clock:
    """The tracer's ``time``: ``sleep`` records what it was asked and moves the clock on by
    that and ``late`` more (a real sleep ends late), ``perf_counter`` reads the clock."""

    def __init__(self, late: float) -> None:
        self.now, self.late, self.asked = 0.0, late, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.now += seconds + self.late


@pytest.mark.parametrize("lines", [0, 1000])
def test_the_stretch_sleeps_its_share_at_each_line(lines, monkeypatch):
    """Paid as it went, in sleeps of 2 ms or more, each sleep's lateness taken off the next
    (on a clock whose sleeps end 0.5 ms late): at the end at most one sleep's worth is owed,
    or one lateness overpaid."""
    clock = _Clock(late=0.0005)
    monkeypatch.setattr(fault_hooks, "time", clock)
    tracer = fault_hooks._Tracer(0.001 if lines else 0.0)
    for _ in range(lines or 10):
        tracer(None, "line", None)
    assert tracer.lines == (lines or 10)
    assert all(seconds >= 0.002 for seconds in clock.asked)
    assert len(clock.asked) == (333 if lines else 0)  # every 3 lines: 2.5 ms asked, 3 ms slept
    assert clock.now == pytest.approx(lines * 0.001 - tracer.owed, abs=1e-9)
    assert -clock.late - 1e-9 <= tracer.owed < 0.002


@pytest.mark.parametrize(
    ("rc2", "resumed", "line", "traceback", "outcome", "ok"),
    [
        (2, None, "rlwire-train: error: /r/checkpoints/step_4/actor/.metadata: damaged", False,
         "refused, naming the file", True),
        # a line that names only a sibling (DCP's per-rank __0.metadata) does not name it
        (2, None, "rlwire-train: error: /r/checkpoints/step_4/actor/__0.metadata: missing", False,
         "refused", False),
        (1, None, "UnicodeDecodeError: 'utf-8' codec can't decode byte", True, "traceback", False),
        (0, "step_4", "", False, "loaded it, completed", False),
        (2, "step_4", "rlwire-train: error: rollout worker 0 stopped", False,
         "loaded it, then failed", False),
        (0, "step_2", "", False, "resumed from step_2, completed", True),
    ],
)  # fmt: skip
def test_a_corrupted_checkpoint_passes_only_refused_by_name_or_skipped(
    rc2, resumed, line, traceback, outcome, ok
):
    from rlwire.trainer.tools.fault_specials import _corrupt_verdict

    record = {
        "corrupted": "step_4/actor/.metadata",
        "rc2": rc2,
        "resumed_from": resumed,
        "second_line": line,
        "second_traceback": traceback,
    }
    verdict = _corrupt_verdict(record)
    assert verdict["outcome"] == outcome
    assert any(verdict["special_failures"].values()) is not ok


def test_a_full_disk_must_be_named_by_the_stop_line():
    from rlwire.trainer.tools.fault_specials import _enospc_verdict

    record = {
        "landed": True,
        "rc1": 2,
        "saved_anyway": False,
        "stop_line": "rlwire-train: error: saving: CheckpointException: ranks:dict_keys([0, 1])",
    }
    failed = _enospc_verdict(record)["special_failures"]
    assert [name for name, bad in failed.items() if bad] == [
        "ENOSPC: the stop line does not name it"
    ]
    record["stop_line"] = (
        "rlwire-train: error: saving: actor rank 0: [Errno 28] No space left on device"
    )
    assert not any(_enospc_verdict(record)["special_failures"].values())


@pytest.mark.parametrize(
    ("stderr", "returncode", "clean"),
    [
        ("rlwire-train: error: update: actor rank 1 died (ActorDiedError: ...)\n", 2, True),
        ("Traceback (most recent call last):\n  ...\nray.exceptions.ActorDiedError: x\n", 1, False),
        ("", 0, True),  # a worker killed after the last step that needed it: the run finished
        ("Traceback (most recent call last):\n  ...\n", 0, False),
        ("some warning\n", 2, False),
    ],
)
def test_a_first_run_ends_cleanly_with_one_error_line_or_finished(
    tmp_path, stderr, returncode, clean
):
    from rlwire.trainer.tools.fault_runs import stop_line

    path = tmp_path / "run1.err"
    path.write_text(stderr)
    assert stop_line(path, returncode)[1] is clean


def _save_actor_state(directory: Path, *, nudge_optimizer: bool = False) -> None:
    """A ``checkpoints/step_8`` of a tiny model after one Adam step, saved with DCP as the
    actor ranks save theirs; ``nudge_optimizer``: one bit of one optimizer entry flipped."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if nudge_optimizer:
        exp_avg = state["optimizer"]["state"][0]["exp_avg"]
        exp_avg.view(torch.int32)[0, 0] ^= 1  # the last bit of one float
    directory.mkdir(parents=True)
    dcp.save(state, checkpoint_id=directory / "actor", no_dist=True)
    (directory / "COMPLETE").write_text("8")


def test_the_model_check_names_an_optimizer_state_that_differs(tmp_path):
    """A resume that lost or skipped the optimizer state trains the same steps and groups:
    only the final optimizer state tells. Two checkpoints whose weights are equal and whose
    optimizer states differ by one bit are not the same model, and the entry is named."""
    _save_actor_state(tmp_path / "reference")
    _save_actor_state(tmp_path / "same")
    _save_actor_state(tmp_path / "run" / "checkpoints" / "step_8", nudge_optimizer=True)
    reference = fault_model.actor_state(tmp_path / "reference")
    assert not any(p.name == "actor.pt" for p in tmp_path.rglob("*"))  # converted elsewhere
    assert fault_model.model_diff(fault_model.actor_state(tmp_path / "same"), reference) == []
    trial = Trial(name="t", mode="one_step_off", target="actor0", phase="save", seed=1)
    references = fault_model.References(tmp_path)
    references.states[trial.mode, trial.run_seed, trial.world, None] = reference  # as if run
    compared = fault_model.compare_model(trial, tmp_path / "run", references, restarted=False)
    assert compared["same_model"] is False and compared["exact_expected"] is True
    assert compared["model_diff"] == ["optimizer/state/0/exp_avg"]
    assert fault_model.model_diff(reference, {"model": reference["model"]})[0].startswith(
        "optimizer/"
    )


def test_a_no_survivor_regeneration_makes_the_model_check_informational(tmp_path):
    from rlwire.trainer.runtime import healing

    # the line the campaign looks for is the healing's own
    assert fault_model.NO_SURVIVOR in Path(healing.__file__).read_text()
    records = [{"step": 1, "weight_version": 1}, {"step": 2, "weight_version": 2,
               "regenerated_groups": 4}]  # fmt: skip
    assert fault_model.regenerated(tmp_path, records) == (4, False)
    (tmp_path / "train.log").write_text(
        "... are generated again by " + fault_model.NO_SURVIVOR + ": it took the actor's)\n"
    )
    assert fault_model.regenerated(tmp_path, records[:1]) == (0, True)
    assert fault_model.exact_expected("one_step_off", no_survivor=False)
    assert not fault_model.exact_expected("one_step_off", no_survivor=True)
    assert not fault_model.exact_expected("fully_async", no_survivor=False)


def test_a_trial_resumed_from_step_k_needs_the_reference_resumed_at_k():
    """After a restart that resumed from ``step_K`` the reference is the unfaulted run
    resumed at K; without a restart, after a restart that started over, or one that resumed
    from the final checkpoint only to export, the unfaulted run."""
    assert fault_model.reference_step(restarted=False, resumed_from=None) is None
    assert fault_model.reference_step(restarted=True, resumed_from="step_4") == 4
    assert fault_model.reference_step(restarted=True, resumed_from="step_2") == 2
    assert fault_model.reference_step(restarted=True, resumed_from=None) is None
    assert fault_model.reference_step(restarted=True, resumed_from="step_8") is None


def test_a_restarted_trial_is_compared_exactly_with_the_reference_resumed_at_its_step(tmp_path):
    """A restarted one-step off trial is exact against the reference resumed at its step,
    and only that one: equal to it passes whatever the unfaulted run holds; a resume that
    skipped the optimizer state (its moments differ) is named."""
    _save_actor_state(tmp_path / "resumed")
    _save_actor_state(tmp_path / "unfaulted", nudge_optimizer=True)  # lag 0 once: differs
    _save_actor_state(tmp_path / "run" / "checkpoints" / "step_8")
    _save_actor_state(tmp_path / "skipped" / "checkpoints" / "step_8", nudge_optimizer=True)
    trial = Trial(name="t", mode="one_step_off", target="actor1", phase="push", seed=1)
    references = fault_model.References(tmp_path)
    key = (trial.mode, trial.run_seed, trial.world)
    references.states[(*key, None)] = fault_model.actor_state(tmp_path / "unfaulted")
    references.states[(*key, 4)] = fault_model.actor_state(tmp_path / "resumed")
    compared = fault_model.compare_model(
        trial, tmp_path / "run", references, restarted=True, resumed_from="step_4"
    )
    assert compared["exact_expected"] is True and compared["same_model"] is True
    assert compared["reference"] == "resumed at step_4"
    skipped = fault_model.compare_model(
        trial, tmp_path / "skipped", references, restarted=True, resumed_from="step_4"
    )
    assert skipped["same_model"] is False and skipped["model_diff"] == ["optimizer/state/0/exp_avg"]
    assert failures({**_SOUND, **skipped}) == ["model differs from its reference's"]
    unfaulted = fault_model.compare_model(
        trial, tmp_path / "skipped", references, restarted=False, resumed_from=None
    )
    assert unfaulted["reference"] == "unfaulted" and unfaulted["same_model"] is True
    # informational (fully async): the unfaulted run, no reference resumed for it
    loose = Trial(name="t", mode="fully_async", target="actor1", phase="push", seed=1)
    references.states[(loose.mode, loose.run_seed, loose.world, None)] = references.states[
        (*key, None)
    ]
    informational = fault_model.compare_model(
        loose, tmp_path / "run", references, restarted=True, resumed_from="step_4"
    )
    assert informational["reference"] == "unfaulted"
    assert informational["exact_expected"] is False and informational["same_model"] is False
    assert (loose.mode, loose.run_seed, loose.world, 4) not in references.states


def test_a_resumed_reference_needs_the_hooks_and_says_so(tmp_path):
    """Without the hooks' folder the reference cannot be stopped at its step: no run starts,
    the state is None (so an exact trial fails) and the report says why."""
    trial = Trial(name="t", mode="one_step_off", target="driver", phase="save", seed=1)
    references = fault_model.References(tmp_path)
    assert references.state(trial, 4) is None
    assert references.runs[-1]["error"] == "no hooks folder to stop the run with"
    compared = fault_model.compare_model(
        trial, tmp_path, references, restarted=True, resumed_from="step_4"
    )
    assert compared["same_model"] is None and compared["exact_expected"] is True
    assert len(references.runs) == 1  # cached per (mode, seed, world, step)


def test_the_hooks_pause_the_driver_before_complete_of_one_checkpoint(tmp_path):
    """``RLWIRE_FAULT_PAUSE``: ``finish_checkpoint`` of another step goes through; that of
    the named step logs ``pause`` and waits before it writes anything, so a kill there
    leaves the save without ``COMPLETE``."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(Path(fault_hooks.__file__).read_text())
    events = tmp_path / "events.jsonl"
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text("{}")
    script = (
        "from pathlib import Path\n"
        "from rlwire.trainer.outputs.checkpoint import finish_checkpoint\n"
        f"root = Path({str(tmp_path / 'checkpoints')!r})\n"
        "finish_checkpoint(root / 'step_2', 2)\n"
        "finish_checkpoint(root / 'step_4', 4)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(hooks),
        "RLWIRE_FAULT_EVENTS": str(events),
        "RLWIRE_FAULT_PAUSE": "step_4",
    }
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        for _ in range(1200):  # 120 s at most
            if events.exists() and '"pause"' in events.read_text():
                break
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the driver did not pause"
    finally:
        proc.kill()
        proc.wait(timeout=60)
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["ev"], Path(e["path"]).name) for e in logged] == [("pause", "step_4")]
    assert (tmp_path / "checkpoints" / "step_2" / "COMPLETE").read_text() == "2"
    assert not (tmp_path / "checkpoints" / "step_4" / "MANIFEST.json").exists()
    assert not (tmp_path / "checkpoints" / "step_4" / "COMPLETE").exists()


def test_the_hooks_stop_the_driver_right_after_complete_of_one_checkpoint(tmp_path):
    """``RLWIRE_FAULT_STOP``: the named step's ``finish_checkpoint`` writes ``COMPLETE``,
    logs ``stop`` and the driver stops as a SIGTERM stops it (its one-line ``RunError``);
    nothing after it runs (the next save never starts)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(Path(fault_hooks.__file__).read_text())
    events = tmp_path / "events.jsonl"
    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "trainer_state.json").write_text("{}")
    script = (
        "from pathlib import Path\n"
        "from rlwire.trainer.driver import _stopped_by_sigterm\n"
        "from rlwire.trainer.outputs.checkpoint import finish_checkpoint\n"
        f"root = Path({str(tmp_path / 'checkpoints')!r})\n"
        "with _stopped_by_sigterm():\n"
        "    for step in (2, 4, 6):\n"
        "        finish_checkpoint(root / f'step_{step}', step)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(hooks),
        "RLWIRE_FAULT_EVENTS": str(events),
        "RLWIRE_FAULT_STOP": "step_4",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert "RunError: stopped by SIGTERM" in done.stderr.splitlines()[-1]
    logged = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["ev"], Path(e["path"]).name) for e in logged] == [("stop", "step_4")]
    assert (tmp_path / "checkpoints" / "step_4" / "COMPLETE").read_text() == "4"
    assert not (tmp_path / "checkpoints" / "step_6" / "COMPLETE").exists()


def test_the_uncommitted_trial_passes_only_resumed_from_the_save_before():
    from rlwire.trainer.tools.fault_specials import _uncommitted_verdict

    record = {"landed": True, "actors_saved": True, "saved_anyway": False, "resumed_from": "step_2"}
    assert not any(_uncommitted_verdict(record)["special_failures"].values())
    for change, check in [
        ({"saved_anyway": True}, "uncommitted: the cut-off save has COMPLETE"),
        ({"resumed_from": "step_4"}, "uncommitted: the second run did not resume from step_2"),
        ({"landed": False}, "uncommitted: the driver was not killed before COMPLETE"),
    ]:
        failed = _uncommitted_verdict({**record, **change})["special_failures"]
        assert [name for name, bad in failed.items() if bad] == [check]


def test_sigterm_stops_the_driver_with_one_line_and_the_handler_is_restored():
    """SIGTERM to the driver (a scheduler's stop) is a RunError with one line, as any
    stop is (Ray's driver otherwise dies in its own handler with a stack dump)."""
    import os
    import signal

    from rlwire.trainer.driver import _stopped_by_sigterm
    from rlwire.trainer.errors import RunError

    before = signal.getsignal(signal.SIGTERM)
    stopped = pytest.raises(RunError, match=r"^stopped by SIGTERM; the last checkpoint .* intact")
    with stopped, _stopped_by_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode: never reached
    assert signal.getsignal(signal.SIGTERM) is before
