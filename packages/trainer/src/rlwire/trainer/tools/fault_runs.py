"""The fault campaign's runs (:mod:`rlwire.trainer.tools.faults`): the job a trial runs, one
``rlwire-train`` process watched while it runs (its phase events, its processes, its
checkpoints as they complete), what it leaves behind, and the checks of the run directory
it ends with (:mod:`rlwire.trainer.tools.fault_checks`)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import fault_checks as checks

__all__ = [
    "MODES",
    "Trial",
    "Watched",
    "final_checks",
    "kill",
    "overrides",
    "run_seed",
    "stop_line",
    "watch",
]

MODES = ("one_step_off", "fully_async")
STEPS, SAVE_EVERY, KEEP = 8, 2, 2
"""The job: steps, a checkpoint every this many, complete checkpoints kept."""
GRACE_S, LINGER_S, HANG_S, RUN_S = 20.0, 120.0, 120.0, 300.0
"""Seconds a run's processes may outlive it (those of a SIGKILLed driver: ``LINGER_S``); a
run may go on after its fault; a run may take."""
MARKER_ENV = "RLWIRE_FAULT_RUN"


@dataclasses.dataclass(kw_only=True, slots=True)
class Trial:
    name: str
    mode: str
    target: str
    """What is killed (``actor<rank>``, ``rollout0``, ``driver``), or the special trial."""
    phase: str
    seed: int
    """The trial's own seed (what its fault draws from)."""
    run_seed: int = 0
    """``trainer.seed`` of both runs: one per mode in a campaign (:func:`run_seed`), so the
    references (:class:`rlwire.trainer.tools.fault_model.References`: the unfaulted run per
    mode, and one resumed at each step a trial resumed from) serve every trial."""
    world: int = 2
    """``actor.world_size``."""
    occurrence: int = 0
    """Which occurrence of the phase (in its marker process) is hit, from 1."""
    delay: float = 0.0
    """Seconds after that occurrence's start."""
    signal: str = "KILL"
    """The signal the target gets: ``KILL`` or ``TERM``."""


def run_seed(seed: int, mode: str) -> int:
    """``trainer.seed`` of every trial of mode ``mode`` in the campaign of seed ``seed``."""
    return seed * 1000 + 990 + MODES.index(mode)


def overrides(trial: Trial, run_dir: Path) -> list[str]:
    """The command line of both runs of ``trial`` (after ``rlwire-train``)."""
    return [
        "--no-progress",
        f"trainer.mode={trial.mode}",
        f"trainer.steps={STEPS}",
        f"trainer.save_every={SAVE_EVERY}",
        f"trainer.max_checkpoints_to_keep={KEEP}",
        f"trainer.seed={trial.run_seed}",
        f"actor.world_size={trial.world}",
        f"trainer.output_dir={run_dir}",
        f"trainer.rollout_data_dir={run_dir / 'rollout_data'}",
    ]


def kill(pid: int | None, sig: str = "KILL") -> bool:
    """Send ``pid`` SIG``sig`` (``KILL``, ``TERM``, ``STOP``, ``CONT``); whether it existed."""
    if pid is None:
        return False
    try:
        os.kill(pid, signal.Signals[f"SIG{sig}"])
        return True
    except ProcessLookupError:
        return False


class Watched:
    """Run ``number`` of a trial in ``base``: its process, its hooks' events, its processes
    (by a marker in their environment or its Ray temp dir in their command line) and their
    pids. Each run has a Ray temp dir of its own (``RAY_TMPDIR``; short: Ray's socket paths
    must stay under 108 bytes)."""

    def __init__(self, trial: Trial, base: Path, number: int, env: dict[str, str]) -> None:
        self.trial, self.run_dir = trial, base / "run"
        marker = f"{base.parent.name}-{trial.name}-{number}-{os.getpid()}"
        self.marker = f"{MARKER_ENV}={marker}".encode()
        self.ray_tmp = tempfile.mkdtemp(prefix="rlf-", dir="/tmp")
        self.env = {**env, MARKER_ENV: marker, "RAY_TMPDIR": self.ray_tmp}
        self.events_path = Path(env.get("RLWIRE_FAULT_EVENTS", base / f"events{number}.jsonl"))
        self.err = base / f"run{number}.err"
        self.pids: set[int] = set()
        self.roles: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self._offset = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "rlwire.trainer.cli", *overrides(self.trial, self.run_dir)]
        out = self.err.with_suffix(".out")
        with out.open("w") as stdout, self.err.open("w") as stderr:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=stdout, stderr=stderr)
        self.pids.add(self.proc.pid)
        self.started = time.monotonic()

    def poll_events(self) -> None:
        if not self.events_path.exists():
            return
        with self.events_path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        for event in map(json.loads, data[:end].splitlines()):
            self.pids.add(event["pid"])
            if event["ev"] == "init":
                self.roles[event["role"]] = event["pid"]
            self.events.append(event)

    def find(self, role: str, phase: str, n: int, ev: str) -> dict[str, Any] | None:
        """The event ``ev`` (``b``, ``e``) of occurrence ``n`` of ``phase`` in ``role``."""
        for e in self.events:
            if (e.get("role"), e.get("phase"), e.get("n"), e["ev"]) == (role, phase, n, ev):
                return e
        return None

    def processes(self) -> dict[int, str]:
        """The run's live processes: pid -> command line (remembered in :attr:`pids`)."""
        found = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                environ = Path(entry.path, "environ").read_bytes().split(b"\0")
                args = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:  # gone meanwhile
                continue
            if self.marker in environ or self.ray_tmp.encode() in args:
                found[int(entry.name)] = args.decode(errors="replace").strip()[:160]
        self.pids |= found.keys()
        return found

    def leftovers(self, *, lingering: bool = False) -> tuple[dict[int, str], list[str]]:
        """Processes of the run alive :data:`GRACE_S` after it ended and the ckpt engine's shm
        segments its processes made (removed). The processes are killed, unless they may
        linger (``lingering``: Ray's agents outlive a SIGKILLed driver by about a minute;
        :meth:`outlived` checks them later)."""
        self.ended = time.monotonic()
        deadline = self.ended + GRACE_S
        while (alive := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        if not lingering:
            for pid in alive:
                kill(pid)
        shm = checks.shm_leftovers(os.listdir("/dev/shm"), self.pids)
        for name in shm:
            Path("/dev/shm", name).unlink(missing_ok=True)
        return alive, shm

    def outlived(self, lingering: dict[int, str]) -> dict[int, str]:
        """Those of ``lingering`` still alive :data:`LINGER_S` after the run ended (then
        killed). Ray's dashboard and runtime-env agents notice their raylet's death at once
        but then wait on the dead GCS to flush their logs: about 60 s here."""
        deadline = self.ended + LINGER_S
        while True:
            alive = {pid: args for pid, args in self.processes().items() if pid in lingering}
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        for pid in alive:
            kill(pid)
        return alive


def digest_new(run_dir: Path, digests: dict[str, dict[str, str]]) -> None:
    """Digest every checkpoint newly complete (``COMPLETE`` is written last)."""
    for complete in sorted((run_dir / "checkpoints").glob("step_*/COMPLETE")):
        if ".partial" in complete.parent.name:  # complete only once renamed step_<n>
            continue
        if complete.parent.name not in digests:
            try:
                digests[complete.parent.name] = checks.digest_checkpoint(complete.parent)
            except OSError:  # pruned while read: the retention policy's to remove
                continue


def watch(
    run: Watched, digests: dict, fault: Callable[[Watched], dict | None] | None = None
) -> dict[str, Any]:
    """Wait for ``run`` to end, digesting checkpoints as they complete and noting its
    processes; ``fault(run)`` is polled until it returns what it did. A run that outlives
    :data:`RUN_S`, or :data:`HANG_S` after the fault, is a hang: it is killed."""
    done, scanned = None, 0.0
    while run.proc.poll() is None:
        run.poll_events()
        if fault is not None and done is None:
            done = fault(run)
        now = time.monotonic()
        if now - scanned > 0.5:
            run.processes()
            digest_new(run.run_dir, digests)
            scanned = now
        if now - (done["monotonic"] if done else run.started) > (HANG_S if done else RUN_S):
            run.proc.kill()
            run.proc.wait()
            return {"fault": done, "hang": True}
        time.sleep(0.003)
    run.poll_events()
    digest_new(run.run_dir, digests)
    return {"fault": done, "hang": False}


def stop_line(path: Path, returncode: int | None = None) -> tuple[str, bool]:
    """A run's last line on stderr, and whether it ended cleanly: no traceback, and either
    that line is ``rlwire-train: error: ...`` or the run finished (``returncode`` 0: a
    worker killed after the last step that needed it)."""
    text = path.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    stopped = last.startswith("rlwire-train: error:") or returncode == 0
    return last, stopped and "Traceback" not in text


def final_checks(trial: Trial, run_dir: Path) -> dict[str, Any]:
    """Steps, prompt groups and weight versions of the run directory after both runs."""
    from ..config import load_config
    from ..data.dataset import load_data

    config = load_config(overrides=overrides(trial, run_dir)[1:])
    size, n = config.data.train_batch_size, config.rollout.n
    data = load_data(config, run_dir)  # built-in tasks generate from the seed and the step
    records = checks.step_records(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in records]
    prompts = {s: trained_prompts(run_dir / "rollout_data", s, n) for s in steps}
    extra: dict[str, Any] = {}
    mismatched = 0
    if trial.mode == "fully_async":
        trained = [(r["step"], r["group_indices"]) for r in records]
        state = run_dir / "checkpoints" / f"step_{STEPS}" / "trainer_state.json"
        queue = json.loads(state.read_text())["queue"] if state.exists() else {}
        extra = {
            "pending": queue.get("pending", []),
            "started": queue.get("next_group", 0),
        }
        mismatched = checks.prompt_mismatches(
            trained, prompts, lambda i: json.dumps(data(i // size)[i % size].prompt)
        )
    else:  # a step's prompts are its data batch's: which one, from the prompts
        trained = checks.indices_from_prompts(
            [(s, prompts[s]) for s in steps],
            lambda b: [json.dumps(e.prompt) for e in data(b)],
            STEPS + 4,
        )
    counted = checks.accounting(trained, steps=STEPS, batch_size=size, **extra)
    return {
        "steps": steps,
        **counted,
        "prompt_mismatches": mismatched,
        "versions_back": checks.versions_back(records),
    }


def trained_prompts(directory: Path, step: int, n: int) -> list[str]:
    """A step's trained prompts in group order (``rollout_data_dir``: ``n`` lines a group),
    as JSON text."""
    path = directory / f"{step}.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [json.dumps(line["prompt"]) for line in lines[::n]]
