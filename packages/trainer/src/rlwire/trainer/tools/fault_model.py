"""The fault campaign's model check (:mod:`rlwire.trainer.tools.faults`): a trial's trained
model and optimizer state against an unfaulted run of the same job and run seed.

The other checks compare what a run logged (steps, prompt groups, weight versions); a
resume that dropped the optimizer state, or loaded the weights of the wrong step, passes
them all. This one reads the final checkpoint's actor state (DCP, read without a process
group) and compares every tensor bit for bit (``torch.equal``) with the reference's.

Which reference (:func:`reference_step`): a trial that completed without a restart (or
whose second run found no checkpoint and started over) is compared with the unfaulted
run. A trial whose second run resumed from ``checkpoints/step_K`` is compared with the
unfaulted run *resumed at the same step*: the same command stopped right after its
``step_K`` is complete (the hooks' ``RLWIRE_FAULT_STOP``: the driver SIGTERMs itself there,
as a scheduler's stop does), then run again to the end. A resumed one-step off-policy run
is not the unfaulted one: it generates the batch after its checkpoint with the restored
weights (lag 0 once), where the unfaulted run used weights one step older (found by this
check's first campaign); resumed at the same step, it is deterministic again. A
comparison that is only informational (fully async, a healed worker with no survivor)
takes the unfaulted run: no reference is run for it alone.

Exactness is expected where the job is deterministic (:func:`exact_expected`): one-step
off-policy, where each step trains a fixed data batch and each generation call is seeded
from ``trainer.seed``, the step and the worker; not in fully async (timing decides which
groups each version trains: the group indices are checked instead), nor after a healed
rollout worker with no survivor regenerated its share with the actor's current, newer
weights (:mod:`rlwire.trainer.runtime.healing`)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from . import fault_checks as checks
from .fault_runs import STEPS, Trial, Watched, watch

__all__ = [
    "NO_SURVIVOR",
    "References",
    "actor_state",
    "compare_model",
    "exact_expected",
    "model_diff",
    "reference_step",
    "regenerated",
]

NO_SURVIVOR = "the replacement (no worker held the batch's weights"
"""The healing's log line when the lost share was generated again with the actor's weights."""


def actor_state(checkpoint: Path) -> dict[str, Any]:
    """The actor state of a ``checkpoints/step_<n>`` (``{"model": ..., "optimizer": ...}``,
    full CPU tensors), read in place with the checkpoint reader's safe unpickling (never
    ``torch.load(weights_only=False)``: a checkpoint directory can come from elsewhere)."""
    from ..outputs.checkpoint_reader import read_state

    return read_state(checkpoint / "actor")


def _entries(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """Every leaf of nested dicts and lists, by its path (``optimizer/state/w/exp_avg``)."""
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _entries(value[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _entries(item, f"{prefix}/{i}")
    else:
        yield prefix, value


def model_diff(state: Mapping[str, Any], reference: Mapping[str, Any]) -> list[str]:
    """The entries of ``state`` that differ from ``reference``'s, in path order: a tensor
    whose dtype, shape or any bit differs (``torch.equal``), another value that is not
    equal, an entry only one of them has. Empty: the same model and optimizer state."""
    import torch

    ours, theirs = dict(_entries(state, "")), dict(_entries(reference, ""))
    differ = []
    for path in sorted(ours.keys() | theirs.keys()):
        if path not in ours or path not in theirs:
            side = "trial" if path in ours else "reference"
            differ.append(f"{path} (only in the {side})")
            continue
        a, b = ours[path], theirs[path]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            same = type(a) is type(b) and a == b
        if not same:
            differ.append(path)
    return differ


def regenerated(run_dir: Path, records: list[dict[str, Any]]) -> tuple[int, bool]:
    """Prompt groups a healed run generated again (``regenerated_groups``, over its step
    lines) and whether a replacement did so with the actor's weights (no survivor: the
    log line :data:`NO_SURVIVOR` in ``train.log``, which both runs append to)."""
    count = sum(r.get("regenerated_groups") or 0 for r in records)
    log = run_dir / "train.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return count, NO_SURVIVOR in text


def exact_expected(mode: str, no_survivor: bool) -> bool:
    """Whether a completed trial must end with its reference's model bit for bit (its
    reference: :func:`reference_step`): one-step off-policy, not healed by a replacement
    with newer weights."""
    return mode == "one_step_off" and not no_survivor


def reference_step(restarted: bool, resumed_from: str | None) -> int | None:
    """The step ``K`` at which a trial's reference is resumed (its second run resumed from
    ``resumed_from``, ``step_K``); None: the unfaulted run itself (no restart; a restart
    that started over; or one that resumed from the final checkpoint, only to export,
    whose state is the unfaulted run's)."""
    if not restarted or resumed_from is None:
        return None
    step = int(resumed_from.removeprefix("step_"))
    return step if 0 < step < STEPS else None


class References:
    """The references a campaign's trials need (of ``modes``: the trials of other modes are
    not compared), each run once, when the first completed trial that needs it asks, in
    ``out/reference-...`` (removed once read, unless ``keep``): per (mode, run seed, world
    size), the unfaulted run, and per step ``K`` a trial resumed from, the unfaulted run
    stopped after ``step_K`` and resumed (its first run carries ``hooks``, the folder
    holding the hooks as ``sitecustomize``; without one, no resumed reference). ``runs``:
    each reference's name, exit status, seconds and what went wrong (``error``), for the
    campaign's report."""

    def __init__(
        self,
        out: Path,
        *,
        modes: Iterable[str] = ("one_step_off", "fully_async"),
        keep: bool = False,
        hooks: Path | None = None,
    ) -> None:
        self.out, self.keep, self.modes, self.hooks = out, keep, frozenset(modes), hooks
        self.states: dict[tuple[str, int, int, int | None], dict[str, Any] | None] = {}
        self.runs: list[dict[str, Any]] = []

    def state(self, trial: Trial, resumed_at: int | None = None) -> dict[str, Any] | None:
        """The reference's final actor state for ``trial``'s job, resumed at step
        ``resumed_at`` (None: the unfaulted run); None: its run failed."""
        key = (trial.mode, trial.run_seed, trial.world, resumed_at)
        if key not in self.states:
            self.states[key] = self._run(*key)
        return self.states[key]

    def _run(self, mode: str, seed: int, world: int, at: int | None) -> dict[str, Any] | None:
        name = f"reference-{mode}-{seed}-{world}" + (f"-resumed{at}" if at else "")
        job = Trial(name=name, mode=mode, target="none", phase="none", seed=seed,
                    run_seed=seed, world=world, signal="")  # fmt: skip
        base = self.out / job.name
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        plain = {k: v for k, v in os.environ.items() if not k.startswith("RLWIRE_FAULT")}
        started = time.monotonic()
        record: dict[str, Any] = {"name": job.name, "rc": None, "hang": False, "error": None}
        if at is not None:
            record["error"] = self._stop_at(job, base, plain, at)
        if record["error"] is None:
            run, hang = self._complete(job, base, 2 if at else 1, plain)
            record.update(rc=run.proc.returncode, hang=hang)
            final = run.run_dir / "checkpoints" / f"step_{STEPS}"
            if run.proc.returncode != 0 or hang or not (final / "COMPLETE").exists():
                record["error"] = f"no complete step_{STEPS} (rc {run.proc.returncode})"
        state = actor_state(final) if record["error"] is None else None
        self.runs.append({**record, "seconds": round(time.monotonic() - started, 1)})
        if state is not None and not self.keep:
            shutil.rmtree(base, ignore_errors=True)
        return state

    def _complete(
        self, job: Trial, base: Path, number: int, env: dict[str, str]
    ) -> tuple[Watched, bool]:
        """Run ``number`` of the reference to its end (its leftovers removed); whether it
        hung."""
        run = Watched(job, base, number, env)
        run.start()
        hang = watch(run, {})["hang"]
        run.leftovers()
        shutil.rmtree(run.ray_tmp, ignore_errors=True)
        return run, hang

    def _stop_at(self, job: Trial, base: Path, plain: dict[str, str], at: int) -> str | None:
        """The reference's first run, stopped right after ``step_<at>`` is complete; what
        went wrong (None: stopped there, ``step_<at>`` its latest complete checkpoint)."""
        if self.hooks is None:
            return "no hooks folder to stop the run with"
        path = os.pathsep.join(filter(None, [str(self.hooks), plain.get("PYTHONPATH")]))
        env = {**plain, "PYTHONPATH": path, "RLWIRE_FAULT_STOP": f"step_{at}",
               "RLWIRE_FAULT_EVENTS": str(base / "events1.jsonl")}  # fmt: skip
        run, _ = self._complete(job, base, 1, env)
        stopped = any(e["ev"] == "stop" for e in run.events)
        complete = sorted(
            int(p.parent.name.removeprefix("step_"))
            for p in (run.run_dir / "checkpoints").glob("step_*/COMPLETE")
            if ".partial" not in p.parent.name  # (renamed step_<n> once complete)
        )
        if not stopped or run.proc.returncode == 0 or not complete or complete[-1] != at:
            return (
                f"the run meant to stop after step_{at} did not (rc {run.proc.returncode}, "
                f"stopped {stopped}, complete {complete})"
            )
        return None


def compare_model(
    trial: Trial,
    run_dir: Path,
    references: References,
    *,
    restarted: bool,
    resumed_from: str | None = None,
) -> dict[str, Any]:
    """A completed trial's final model and optimizer state against its reference's
    (``restarted``: its first run failed; ``resumed_from``: the checkpoint its second run
    resumed from, ``step_K``; :func:`reference_step`; where exactness is not expected, the
    unfaulted run's, informational): ``same_model`` (None: not compared),
    ``model_diff`` (the first differing entries, or why there was nothing to compare),
    ``reference`` (``unfaulted`` or ``resumed at step_K``), ``regenerated_groups``,
    ``no_survivor`` and ``exact_expected`` (whether a difference is a failure)."""
    records = checks.step_records(run_dir / "metrics.jsonl")
    count, no_survivor = regenerated(run_dir, records)
    exact = exact_expected(trial.mode, no_survivor)
    # an informational comparison takes the unfaulted run: no reference run for it alone
    at = reference_step(restarted, resumed_from) if exact else None
    fields: dict[str, Any] = {
        "regenerated_groups": count,
        "no_survivor": no_survivor,
        "exact_expected": exact,
        "reference": "unfaulted" if at is None else f"resumed at step_{at}",
    }
    reference = references.state(trial, at)
    final = run_dir / "checkpoints" / f"step_{STEPS}"
    if reference is None:
        return {**fields, "same_model": None, "model_diff": ["no reference: its run failed"]}
    if not (final / "COMPLETE").exists():
        return {**fields, "same_model": None, "model_diff": [f"no complete step_{STEPS}"]}
    differ = model_diff(actor_state(final), reference)
    more = [f"... {len(differ) - 3} more"] if len(differ) > 3 else []
    return {**fields, "same_model": not differ, "model_diff": differ[:3] + more}
