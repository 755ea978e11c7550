"""The fault campaign's checks on hand-built inputs (no runs): each one flags a tampered
input, and passes a sound one."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlwire.trainer.tools import fault_checks as checks
from rlwire.trainer.tools import fault_hooks
from rlwire.trainer.tools.faults import MODES, PHASES, TARGETS, failures, plan


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


def test_fully_async_accounting_counts_pending_and_dropped_groups():
    trained = steps_of([[0, 2], [1, 4]])
    # started 6: 0-2 and 4 trained, 5 pending in the checkpoint, 3 dropped for its lag
    sound = checks.accounting(trained, steps=2, batch_size=2, pending=[5], started=6, dropped=1)
    assert sound["lost"] == 0 and sound["repeated"] == 0
    lost = checks.accounting(trained, steps=2, batch_size=2, pending=[5], started=7, dropped=1)
    assert lost["lost"] == 1
    # a pending group that was already trained would be trained twice on a resume
    again = checks.accounting(trained, steps=2, batch_size=2, pending=[4, 5], started=6, dropped=1)
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


def test_failures_name_each_failed_check():
    sound = {
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
    assert failures(sound) == []
    bad = {**sound, "repeated": 8, "process_leftovers": 1, "damaged": ["step_4/COMPLETE"]}
    assert failures(bad) == ["groups repeated", "leftovers", "checkpoint damaged"]
    assert failures({**sound, "fault_at_s": None}) == ["fault never happened"]
    assert failures({**sound, "hf_model": False}) == ["completed without hf_model/"]


def test_summary_table_has_a_row_per_mode_fault_and_phase():
    trial = {
        "mode": "fully_async",
        "target": "driver",
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
    table = checks.summary_table([trial, healed])
    assert (
        table.splitlines()[2]
        == "| fully_async | driver | save | 2 | 2 | 2 | 1 | 0 | 2 | 0 | 2 | 0 | 2 | 1 | 45 |"
    )


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


@pytest.mark.parametrize("lines", [0, 1000])
def test_the_stretch_sleeps_its_share_at_each_line(lines):
    tracer = fault_hooks._Tracer(0.001 if lines else 0.0)
    for _ in range(lines or 10):
        tracer(None, "line", None)
    assert tracer.lines == (lines or 10)
    assert abs(tracer.owed) < 0.003  # paid as it went (in sleeps of 2 ms or more)


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
    from rlwire.trainer.tools.faults import _corrupt_verdict

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
    from rlwire.trainer.tools.faults import _enospc_verdict

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
