"""The fault campaign: kill a process of a short run at a random point of a phase, run the
same command again, and check that nothing was lost, repeated, left behind or damaged.

    python -m rlwire.trainer.tools.faults --trials N --seed S [--out DIR]
        [--reference-modes MODE ...] [--special enospc corrupt uncommitted stranger]

Each trial runs the embedded tiny job (``rlwire-train`` with no data or model given: 8
steps, a checkpoint every 2, 2 kept, ``actor.world_size`` 2; :mod:`rlwire.trainer.tools.fault_runs`)
as a subprocess in one-step off-policy or fully-async mode, sends SIGKILL, SIGTERM or
SIGSTOP (in turn: ``signal``; a stopped process gets SIGCONT :data:`PAUSE_S` s later: it
stops answering for a while) to an actor rank, the rollout worker or the driver during
generation, an update, a weight push or a checkpoint save, then runs the same command to
completion. The trials walk the 24 combinations in shuffled rounds (seeded): ``--trials 48``
is every combination twice. The trial's seed draws its fault; the runs' ``trainer.seed`` is
the campaign's, one per mode (:func:`rlwire.trainer.tools.fault_runs.run_seed`), so one
unfaulted reference run per mode (and one resumed at each step a trial resumed from)
serves every trial's model check.

**Phases.** The runs carry :mod:`rlwire.trainer.tools.fault_hooks` as their ``sitecustomize``:
each phase method of the Ray workers logs its start and end (``ActorWorker.train``:
update, ``.save``: save; ``RolloutWorker.generate``: generation, ``.pull_weights`` /
``.stage_weights``, the receiving end of a push, which spans the transfer: push), so
phases are observed exactly. They are short (10-100 ms on the tiny job), so the chosen
occurrence (a random one, counted in the phase's marker process: actor rank 0 for update
and save, rollout worker 0 for generation and push) is stretched to about
:data:`STRETCH_S` s by slowing its Python lines, and the kill comes a uniformly random
delay within that after its start: a random point of its code (time inside one C call is
not stretched, so it is under-sampled). ``landed``: the process existed and the phase had
not ended when it was killed.

**Checks** (:mod:`rlwire.trainer.tools.fault_checks`): the second run exits 0 with steps 1..8 in
``metrics.jsonl`` and ``hf_model/`` exported; no prompt group lost or trained twice (fully
async: the steps' ``group_indices`` with the final checkpoint's pending groups, and each
trained prompt is the data's at its index; one-step off-policy records no indices: each
step's prompts, from ``trainer.rollout_data_dir``, matched to the data's batches);
``weight_version`` never goes back; after each run, no shm segment of the ckpt engine made
by one of its processes is in ``/dev/shm`` and none of its processes is alive 20 s on (found
by a marker in their environment or their Ray temp dir; then killed by pid, and the
segments removed; after a SIGKILLed driver, whose own shutdown never runs, Ray's agents
may take 120 s);
every file of every checkpoint seen complete is byte-identical after each run, unless the
retention policy removed the checkpoint; the final model and optimizer state equal the
reference's bit for bit (:mod:`rlwire.trainer.tools.fault_model`: the unfaulted run, or,
for a trial whose second run resumed from ``step_K``, the unfaulted run stopped after
``step_K`` and resumed; a failure in one-step off-policy, not after a healed worker with no
survivor regenerated its share with newer weights; informational in fully async, where
timing decides what each version trains); a killed worker, or a SIGTERMed driver, stops
the first run with one ``rlwire-train: error:`` line and no traceback, or lets it finish
with exit 0: a rollout worker in one-step off-policy mode, which heals
(:mod:`rlwire.trainer.runtime.healing`; the table's ``no restart``), or any worker killed
after the last step that needed it; a paused process (SIGSTOP) never stops the run: its
first run must exit 0.

**Special trials** (``--special``, :mod:`rlwire.trainer.tools.fault_specials`): ``enospc``
(a full disk during a save), ``corrupt`` (a damaged file of the latest checkpoint),
``uncommitted`` (the driver SIGKILLed after every actor rank's part of ``step_4`` is written
and before ``COMPLETE``: the rerun must resume from ``step_2``), ``stranger`` (a process
without the group's secret writes the weight sync's metadata).

**Table**: per mode, fault (target and signal) and phase: trials, landed, completed, completed
without a restart and after one, groups lost and trained twice, versions back, leftovers,
checkpoint files damaged, same model, clean stops, failed
(:func:`~rlwire.trainer.tools.fault_checks.summary_table`).

Writes ``DIR/trials.jsonl`` and ``DIR/table.md`` and prints the table; a failed trial's
directory (run directory, events, both runs' output) is kept. Exit 1 if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import fault_checks as checks
from .fault_model import References, compare_model
from .fault_runs import (
    MODES,
    STEPS,
    Trial,
    Watched,
    final_checks,
    kill,
    run_seed,
    stop_line,
    watch,
)
from .fault_specials import SPECIALS

__all__ = ["MODES", "SIGNALS", "SPECIALS", "failures", "main", "plan", "run_trial"]

TARGETS = ("actor", "rollout", "driver")
PHASES = ("generation", "update", "push", "save")
MARKER = {"generation": "rollout0", "update": "actor0", "push": "rollout0", "save": "actor0"}
"""The process whose occurrences of a phase are counted, stretched and watched."""
OCCURRENCES = {"generation": (3, 7), "update": (3, 7), "push": (3, 7), "save": (2, 4)}
"""The occurrence hit is drawn from these: a checkpoint is complete before it."""
STRETCH_S = 1.5
SIGNALS = ("KILL", "TERM", "STOP")
"""The signals a kill trial sends, in turn (``STOP``: paused, then SIGCONT)."""
PAUSE_S = 5.0
"""Seconds a SIGSTOPped process stays paused before its SIGCONT."""


def plan(trials: int, seed: int, world: int = 2) -> list[Trial]:
    """``trials`` kill trials: mode x target x phase in shuffled rounds, a random actor rank,
    occurrence and delay each, SIGKILL and SIGTERM alternately; the runs' seed is the
    campaign's per mode (:func:`rlwire.trainer.tools.fault_runs.run_seed`)."""
    rng = random.Random(seed)
    grid = list(itertools.product(MODES, TARGETS, PHASES))
    order: list[tuple[str, str, str]] = []
    while len(order) < trials:
        order += rng.sample(grid, len(grid))
    planned = []
    for i, (mode, target, phase) in enumerate(order[:trials]):
        who = {"actor": f"actor{rng.randrange(world)}", "rollout": "rollout0"}.get(target, target)
        occurrence, delay = rng.randint(*OCCURRENCES[phase]), rng.uniform(0.02, 0.98) * STRETCH_S
        planned.append(
            Trial(
                name=f"t{i:03d}",
                mode=mode,
                target=who,
                phase=phase,
                seed=seed * 1000 + i,
                run_seed=run_seed(seed, mode),
                world=world,
                occurrence=occurrence,
                delay=round(delay, 3),
                signal=SIGNALS[i % len(SIGNALS)],
            )
        )
    return planned


def phase_kill(trial: Trial, env: dict[str, str]) -> Callable[[Watched], dict | None]:
    """Stretch the chosen occurrence (the hooks) and kill the target ``trial.delay`` s after
    its start."""
    role = MARKER[trial.phase]
    env["RLWIRE_FAULT_STRETCH"] = f"{role}:{trial.phase}:{trial.occurrence}:{STRETCH_S}"

    def fault(run: Watched) -> dict | None:
        begin = run.find(role, trial.phase, trial.occurrence, "b")
        if begin is None or time.time() < begin["t"] + trial.delay:
            return None
        pid = run.proc.pid if trial.target == "driver" else run.roles.get(trial.target)
        at, existed = time.time(), kill(pid, trial.signal)
        if trial.signal == "STOP":  # it stops answering for a while, then goes on
            threading.Timer(PAUSE_S, kill, (pid, "CONT")).start()
        return {"at": at, "monotonic": time.monotonic(), "existed": existed, "pid": pid}

    return fault


def landed(trial: Trial, run: Watched, done: dict | None) -> bool:
    """Whether the kill hit a live process inside the chosen occurrence of the phase; in
    fully async's generation, whose occurrences are the prompt groups' coroutines (tens of
    ms, many at once: the stretch of one slows them all), inside any of them."""
    if not done or not done["existed"]:
        return False
    role, at = MARKER[trial.phase], done["at"]
    end = run.find(role, trial.phase, trial.occurrence, "e")
    if end is None or end["t"] > at:
        return True
    if (trial.mode, trial.phase) != ("fully_async", "generation"):
        return False
    begun = {e["n"]: e["t"] for e in run.events if _of(e, role, "b") and e["t"] <= at}
    ended = {e["n"] for e in run.events if _of(e, role, "e") and e["t"] <= at}
    return bool(begun.keys() - ended)


def _of(event: dict, role: str, edge: str) -> bool:
    """Whether ``event`` is a generation edge (``b``, ``e``) of ``role``."""
    return (event.get("role"), event.get("phase"), event["ev"]) == (role, "generation", edge)


def run_trial(
    trial: Trial, out: Path, hooks: Path, references: References | None = None
) -> dict[str, Any]:
    """One trial: the first run with its fault, the same command again, every check; the
    final model against ``references``' run for it (none: not compared)."""
    base = out / trial.name
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    started = time.monotonic()
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RLWIRE_FAULT")}
    path = os.pathsep.join(filter(None, [str(hooks), plain.get("PYTHONPATH")]))
    env = {**plain, "PYTHONPATH": path, "RLWIRE_FAULT_EVENTS": str(base / "events1.jsonl")}
    special = SPECIALS.get(trial.target)
    fault = special.fault(trial, env) if special else phase_kill(trial, env)
    digests: dict[str, dict[str, str]] = {}
    first = Watched(trial, base, 1, env)
    first.start()
    one = watch(first, digests, fault)
    # a SIGKILLed driver's Ray agents linger a while, and it says nothing; on SIGTERM, Ray's
    # handler raises SystemExit in the driver, which stops Ray and must say one line
    killed = trial.target == "driver" and trial.signal == "KILL"
    driver_killed = killed or bool(special and special.kills_driver)
    lingering, shm1 = first.leftovers(lingering=driver_killed)
    damaged1, _ = checks.damaged_files(digests, first.run_dir / "checkpoints")
    r: dict[str, Any] = {**dataclasses.asdict(trial), "rc1": first.proc.returncode}
    r["stop_line"], clean = stop_line(first.err, first.proc.returncode)
    r["clean_stop"] = clean or driver_killed
    r["landed"] = landed(trial, first, one["fault"]) if not special else False
    r["fault_at_s"] = round(one["fault"]["monotonic"] - first.started, 1) if one["fault"] else None
    if special:
        r.update(special.between(trial, first, digests))
    second = Watched(trial, base, 2, plain)  # the same command, without the hooks
    second.start()
    two = watch(second, digests)
    procs2, shm2 = second.leftovers()
    procs1 = first.outlived(lingering)
    damaged2, gone = checks.damaged_files(digests, second.run_dir / "checkpoints")
    log = (second.run_dir / "train.log").read_text().splitlines()
    resumed = [
        line.split("resumed from ")[1].split(" at step")[0]
        for line in log
        if "resumed from " in line
    ]
    r.update(
        rc2=second.proc.returncode,
        second_line=stop_line(second.err)[0],
        second_traceback="Traceback" in second.err.read_text(errors="replace"),
        hang=one["hang"] or two["hang"],
        resumed_from=Path(resumed[-1]).name if resumed else None,
        shm_leftovers=len(shm1) + len(shm2),
        process_leftovers=len(procs1) + len(procs2),
        lingered=sorted(set(lingering.values())) if driver_killed else [],
        leftover_detail=[*shm1, *shm2, *procs1.values(), *procs2.values()],
        damaged=sorted(set(damaged1 + damaged2)),
        pruned=gone,
        **final_checks(trial, second.run_dir),
    )
    r["hf_model"] = (second.run_dir / "hf_model" / "config.json").exists()
    r["completed"] = r["rc2"] == 0 and r["steps"] == list(range(1, STEPS + 1))
    r.update(same_model=None, model_diff=[], exact_expected=False)
    if r["completed"] and references is not None and trial.mode in references.modes:
        referenced = time.monotonic()
        before = sum(run["seconds"] for run in references.runs)
        restarted, resumed_from = r["rc1"] != 0, r["resumed_from"]
        r.update(
            compare_model(
                trial, second.run_dir, references, restarted=restarted, resumed_from=resumed_from
            )
        )
        # a reference run started for this trial is the campaign's time, not the trial's
        started += sum(run["seconds"] for run in references.runs) - before
        r["compare_s"] = round(time.monotonic() - referenced, 1)
    if special:
        r.update(special.verdict(r))
    r["seconds"] = round(time.monotonic() - started, 1)
    r["failed"] = failures(r)
    for number, run in enumerate((first, second), 1):
        logs = Path(run.ray_tmp, "ray", "session_latest", "logs")
        if r["failed"] and logs.is_dir():  # the workers' own errors, for the report
            shutil.copytree(
                logs, base / f"ray_logs{number}", ignore=shutil.ignore_patterns("events")
            )
        shutil.rmtree(run.ray_tmp, ignore_errors=True)
    return r


def failures(r: dict[str, Any]) -> list[str]:
    """The checks a trial failed (none: it passed)."""
    done = r["completed"]
    failed = {
        "fault never happened": r["fault_at_s"] is None and not r["landed"],
        "not completed": not done and not r.get("refused_ok"),
        "hang": r["hang"],
        "completed without hf_model/": done and not r["hf_model"],
        "groups lost": done and r["lost"] != 0,
        "groups repeated": done and r["repeated"] != 0,
        "steps missing or repeated": done and bool(r["missing_steps"] or r["extra_steps"]),
        "trained prompts not the data's": r["prompt_mismatches"] != 0,
        "weight version went back": r["versions_back"] != 0,
        "leftovers": r["shm_leftovers"] + r["process_leftovers"] > 0,
        "checkpoint damaged": bool(r["damaged"]),
        "model differs from its reference's": done
        and r.get("exact_expected", False)
        and r.get("same_model") is not True,
        "first run did not stop with one line": not r["clean_stop"],
        "a paused process stopped the run": r.get("signal") == "STOP" and r["rc1"] != 0,
        **r.get("special_failures", {}),
    }
    return [name for name, bad in failed.items() if bad]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlwire.trainer.tools.faults", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--trials", type=int, default=3, help="kill trials (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="the plan's and the runs' seeds")
    parser.add_argument("--out", type=Path, default=Path("runs/faults"), help="output folder")
    parser.add_argument("--special", nargs="*", default=[], choices=sorted(SPECIALS))
    parser.add_argument("--world-size", type=int, default=2, help="actor.world_size")
    parser.add_argument("--keep", action="store_true", help="keep every trial's directory")
    parser.add_argument(
        "--reference-modes",
        nargs="*",
        default=list(MODES),
        choices=MODES,
        help="the modes whose trials' final model is compared with an unfaulted run of "
        "their own (one per mode, and one resumed at each step a trial resumed from; "
        "default both; none: no comparison)",
    )
    args = parser.parse_args(argv)
    out = args.out.resolve()
    hooks = out / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).with_name("fault_hooks.py"), hooks / "sitecustomize.py")
    trials = plan(args.trials, args.seed, args.world_size)
    for name in args.special:
        trials += SPECIALS[name].trials(args.seed, args.world_size)
    results = []
    references = References(out, modes=args.reference_modes, keep=args.keep, hooks=hooks)
    with (out / "trials.jsonl").open("w") as record:
        for i, trial in enumerate(trials, 1):
            r = run_trial(trial, out, hooks, references)
            results.append(r)
            record.write(json.dumps(r) + "\n")
            record.flush()
            verdict = "ok" if not r["failed"] else "FAILED: " + "; ".join(r["failed"])
            what = f"{trial.mode} {trial.target} {trial.signal} {trial.phase}".replace("  ", " ")
            model = {True: "same", False: "differs", None: "not compared"}[r["same_model"]]
            print(
                f"[{i}/{len(trials)}] {what} #{trial.occurrence} +{trial.delay:.2f} s: landed "
                f"{r['landed']}, rc {r['rc1']}/{r['rc2']}, model {model}, "
                f"{r['seconds']:.0f} s: {verdict}",
                flush=True,
            )
            if not r["failed"] and not args.keep:
                shutil.rmtree(out / trial.name, ignore_errors=True)
    table = checks.summary_table(results)
    (out / "table.md").write_text(table)
    print(table)
    for ref in references.runs if references else []:
        error = f" ({ref['error']})" if ref["error"] else ""
        print(f"reference {ref['name']}: rc {ref['rc']}, {ref['seconds']:.0f} s{error}")
    failed = sum(bool(r["failed"]) for r in results)
    print(f"{len(results)} trials, {failed} failed: {out / 'trials.jsonl'}, {out / 'table.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
