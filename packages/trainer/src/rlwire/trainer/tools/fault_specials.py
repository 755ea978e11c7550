"""The fault campaign's special trials (:mod:`rlwire.trainer.tools.faults`, ``--special``):
faults other than a kill at a random point of a phase, each with what it does to the first
run, what it records between the runs, and its own checks.

- ``enospc``: every write under ``checkpoints/step_4/`` fails with ENOSPC (the hooks' full
  disk): the run must stop with one line naming it, the earlier checkpoints intact, and the
  same command without it must complete.
- ``corrupt``: one trial per file kind of a checkpoint: the driver is killed once ``step_4``
  is complete, bytes are flipped in a file of the latest complete checkpoint, and the same
  command must refuse with one line naming the file, or resume from an earlier checkpoint
  and complete (``outcome`` says which happened).
- ``uncommitted``: the hooks pause the driver in ``finish_checkpoint`` of ``step_4``, after
  every actor rank's part and ``trainer_state.json`` are written and before the manifest and
  ``COMPLETE``; the driver is SIGKILLed there. ``step_4`` must have no ``COMPLETE``, and the
  same command must resume from ``step_2`` and complete (the other checks: nothing damaged,
  lost or repeated, the model that of the unfaulted run stopped after ``step_2`` and
  resumed).
- ``stranger``: a process without the group's secret writes the checkpoint engine's bucket
  metadata during the run (:mod:`rlwire.trainer.tools.fault_stranger`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import fault_checks as checks
from .fault_runs import MODES, SAVE_EVERY, Trial, Watched, kill, run_seed
from .fault_stranger import stranger_between, stranger_fault, stranger_verdict

__all__ = ["CORRUPTIBLE", "SPECIALS", "UNCOMMITTED_STEP", "Special"]

CORRUPTIBLE = ("trainer_state.json", "actor/.metadata", "actor/__0_0.distcp", "rng/actor_rank0.pt")
UNCOMMITTED_STEP = 4
"""The checkpoint whose ``COMPLETE`` the ``uncommitted`` trial never lets the driver write."""


@dataclasses.dataclass(frozen=True, slots=True)
class Special:
    """A special trial: its trials for a seed, its fault on the first run (it may set the
    run's environment; it returns what :func:`rlwire.trainer.tools.fault_runs.watch` polls, or
    None), what it does and records between the runs, and its verdict on the record
    (``special_failures``: check name -> failed)."""

    trials: Callable[[int, int], list[Trial]]
    fault: Callable[[Trial, dict[str, str]], Callable[[Watched], dict | None] | None]
    between: Callable[[Trial, Watched, dict], dict[str, Any]]
    verdict: Callable[[dict[str, Any]], dict[str, Any]]
    kills_driver: bool = False
    """The fault SIGKILLs the driver (its Ray agents linger a while; no stop line)."""


def _enospc_fault(trial: Trial, env: dict[str, str]) -> None:
    # a save is written as step_<n>.partial, then renamed step_<n> once complete
    env["RLWIRE_FAULT_ENOSPC"] = f"/checkpoints/step_{trial.occurrence * SAVE_EVERY}.partial/"


def _enospc_between(trial: Trial, run: Watched, digests: dict) -> dict[str, Any]:
    by = {e["pid"] for e in run.events if e["ev"] == "enospc"}
    roles = sorted(role for role, pid in run.roles.items() if pid in by)
    step = run.run_dir / "checkpoints" / f"step_{trial.occurrence * SAVE_EVERY}"
    return {"landed": bool(roles), "enospc_in": roles, "saved_anyway": (step / "COMPLETE").exists()}


def _enospc_verdict(r: dict[str, Any]) -> dict[str, Any]:
    named = any(s in r["stop_line"] for s in ("No space left", "ENOSPC", "Errno 28"))
    return {
        "special_failures": {
            "ENOSPC never reached a worker": not r["landed"],
            "ENOSPC: the first run did not stop": r["rc1"] == 0,
            "ENOSPC: the stop line does not name it": not named,
            "ENOSPC: the failed save was marked complete": r["saved_anyway"],
        }
    }


def _corrupt_fault(trial: Trial, env: dict[str, str]) -> Callable[[Watched], dict | None]:
    def fault(run: Watched) -> dict | None:
        if not (run.run_dir / "checkpoints" / "step_4" / "COMPLETE").exists():
            return None
        return {"at": time.time(), "monotonic": time.monotonic(), "existed": kill(run.proc.pid)}

    return fault


def _corrupt_between(trial: Trial, run: Watched, digests: dict) -> dict[str, Any]:
    """Flip 16 bytes (seeded place) of the file in the latest complete checkpoint."""
    saved = (run.run_dir / "checkpoints").glob("step_*/COMPLETE")
    latest = max((p for p in saved if ".partial" not in p.parent.name), key=_step_of).parent
    path = latest / trial.phase.removeprefix("resume ")
    data = bytearray(path.read_bytes())
    at = random.Random(trial.seed).randrange(max(1, len(data) - 16))
    data[at : at + 16] = bytes(b ^ 0xFF for b in data[at : at + 16])
    path.write_bytes(bytes(data))
    digests[latest.name] = checks.digest_checkpoint(latest)  # the rerun must leave it so
    return {"landed": True, "corrupted": f"{latest.name}/{path.relative_to(latest)}"}


def _step_of(path: Path) -> int:
    return int(path.parent.name.split("_")[1])


def _corrupt_verdict(r: dict[str, Any]) -> dict[str, Any]:
    step = r["corrupted"].split("/")[0]
    if r["resumed_from"] == step:
        outcome = "loaded it, " + ("completed" if r["rc2"] == 0 else "then failed")
    elif r["rc2"] == 0:
        outcome = f"resumed from {r['resumed_from'] or 'nothing'}, completed"
    elif r["second_traceback"]:
        outcome = "traceback"
    else:
        named = r["corrupted"] in r["second_line"]  # step_N/actor/.metadata, not __0.metadata
        outcome = "refused" + (", naming the file" if named else "")
    ok = ("refused, naming the file", f"resumed from {r['resumed_from'] or 'nothing'}, completed")
    return {
        "outcome": outcome,
        "refused_ok": outcome == ok[0],
        "special_failures": {f"corrupt checkpoint: {outcome}": outcome not in ok},
    }


def _uncommitted_fault(trial: Trial, env: dict[str, str]) -> Callable[[Watched], dict | None]:
    env["RLWIRE_FAULT_PAUSE"] = f"step_{UNCOMMITTED_STEP}"

    def fault(run: Watched) -> dict | None:
        if not any(e["ev"] == "pause" for e in run.events):
            return None
        return {"at": time.time(), "monotonic": time.monotonic(), "existed": kill(run.proc.pid)}

    return fault


def _uncommitted_between(trial: Trial, run: Watched, digests: dict) -> dict[str, Any]:
    step = run.run_dir / "checkpoints" / f"step_{UNCOMMITTED_STEP}"
    paused = any(e["ev"] == "pause" for e in run.events)
    ranks = [step / "rng" / f"actor_rank{r}.pt" for r in range(trial.world)]
    return {
        "landed": paused and run.proc.returncode == -9,
        "actors_saved": (step / "actor" / ".metadata").is_file() and all(map(Path.is_file, ranks)),
        "saved_anyway": (step / "COMPLETE").exists(),
    }


def _uncommitted_verdict(r: dict[str, Any]) -> dict[str, Any]:
    earlier = f"step_{UNCOMMITTED_STEP - SAVE_EVERY}"
    return {
        "special_failures": {
            "uncommitted: the driver was not killed before COMPLETE": not r["landed"],
            "uncommitted: the actors' part was not written": not r["actors_saved"],
            "uncommitted: the cut-off save has COMPLETE": r["saved_anyway"],
            f"uncommitted: the second run did not resume from {earlier}": r["resumed_from"]
            != earlier,
        }
    }


SPECIALS: dict[str, Special] = {
    "enospc": Special(
        trials=lambda seed, world: [
            Trial(
                name="enospc",
                mode=MODES[seed % 2],
                target="enospc",
                phase="save",
                seed=seed * 1000 + 900,
                signal="",
                run_seed=run_seed(seed, MODES[seed % 2]),
                world=world,
                occurrence=2,
            )
        ],
        fault=_enospc_fault,
        between=_enospc_between,
        verdict=_enospc_verdict,
    ),
    "stranger": Special(
        trials=lambda seed, world: [
            Trial(
                name="stranger",
                mode=MODES[seed % 2],
                target="stranger",
                phase="push",
                seed=seed * 1000 + 950,
                signal="",
                run_seed=run_seed(seed, MODES[seed % 2]),
                world=world,
            )
        ],
        fault=stranger_fault,
        between=stranger_between,
        verdict=stranger_verdict,
    ),
    "corrupt": Special(
        trials=lambda seed, world: [
            Trial(
                name=f"corrupt{i}",
                mode=MODES[(seed + i) % 2],
                target="corrupt",
                phase=f"resume {file}",
                seed=seed * 1000 + 910 + i,
                run_seed=run_seed(seed, MODES[(seed + i) % 2]),
                world=world,
            )
            for i, file in enumerate(CORRUPTIBLE)
        ],
        fault=_corrupt_fault,
        between=_corrupt_between,
        verdict=_corrupt_verdict,
        kills_driver=True,
    ),
    "uncommitted": Special(
        trials=lambda seed, world: [
            Trial(
                name="uncommitted",
                mode=MODES[seed % 2],
                target="uncommitted",
                phase="save",
                seed=seed * 1000 + 960,
                run_seed=run_seed(seed, MODES[seed % 2]),
                world=world,
                occurrence=UNCOMMITTED_STEP // SAVE_EVERY,
            )
        ],
        fault=_uncommitted_fault,
        between=_uncommitted_between,
        verdict=_uncommitted_verdict,
        kills_driver=True,
    ),
}
"""Special trials by name (``--special``)."""
