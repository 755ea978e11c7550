"""The fault campaign's model check (:mod:`rlwire.trainer.tools.faults`): a trial's trained
model and optimizer state against an unfaulted run of the same job and run seed.

The other checks compare what a run logged (steps, prompt groups, weight versions); a
resume that dropped the optimizer state, or loaded the weights of the wrong step, passes
them all. This one reads the final checkpoint's actor state (DCP, read without a process
group) and compares every tensor bit for bit (``torch.equal``) with the reference's.

Exactness is expected where the job is deterministic: one-step off-policy without a
restart, where each step trains a fixed data batch and each generation call is seeded from
``trainer.seed``, the step and the worker. It is not expected after a restart (the resumed
run generates the batch after its checkpoint with the restored weights, lag 0 once, where
the unfaulted run used weights one step older: found by this check's first campaign), nor
in fully async (timing decides which groups each version trains: the group indices are
checked instead), nor after a healed rollout worker with no survivor regenerated its
share with the actor's current, newer weights (:mod:`rlwire.trainer.runtime.healing`)."""

from __future__ import annotations

import os
import shutil
import tempfile
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
    "regenerated",
]

NO_SURVIVOR = "the replacement (no worker held the batch's weights"
"""The healing's log line when the lost share was generated again with the actor's weights."""


def actor_state(checkpoint: Path) -> dict[str, Any]:
    """The actor state of a ``checkpoints/step_<n>`` (``{"model": ..., "optimizer": ...}``,
    full CPU tensors), converted through a temporary file outside the checkpoint (whose
    bytes the campaign checks)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="rlwire-faults-") as scratch:
        whole = Path(scratch) / "actor.pt"
        dcp_to_torch_save(checkpoint / "actor", whole)
        return torch.load(whole, weights_only=False)


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


def exact_expected(mode: str, no_survivor: bool, restarted: bool) -> bool:
    """Whether a completed trial must end with the reference's model bit for bit: one-step
    off-policy, completed without a restart, and not healed by a replacement with newer
    weights. A restart is not exact either: the resumed run generates the batch after its
    checkpoint with the restored weights (lag 0 once), where the unfaulted run used the
    weights one step older (docs/trainer/checkpoints.md, "Resuming")."""
    return mode == "one_step_off" and not no_survivor and not restarted


class References:
    """The unfaulted run of each (mode, run seed, world size) a campaign's trials need (of
    ``modes``: the trials of other modes are not compared), run
    once, when the first completed trial of that kind asks for it, in ``out/reference-...``
    (removed once read, unless ``keep``). ``runs``: each reference's name, exit status and
    seconds, for the campaign's report."""

    def __init__(
        self,
        out: Path,
        *,
        modes: Iterable[str] = ("one_step_off", "fully_async"),
        keep: bool = False,
    ) -> None:
        self.out, self.keep, self.modes = out, keep, frozenset(modes)
        self.states: dict[tuple[str, int, int], dict[str, Any] | None] = {}
        self.runs: list[dict[str, Any]] = []

    def state(self, trial: Trial) -> dict[str, Any] | None:
        """The reference's final actor state for ``trial``'s job (None: its run failed)."""
        key = (trial.mode, trial.run_seed, trial.world)
        if key not in self.states:
            self.states[key] = self._run(*key)
        return self.states[key]

    def _run(self, mode: str, seed: int, world: int) -> dict[str, Any] | None:
        job = Trial(name=f"reference-{mode}-{seed}-{world}", mode=mode, target="none",
                    phase="none", seed=seed, run_seed=seed, world=world, signal="")  # fmt: skip
        base = self.out / job.name
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        plain = {k: v for k, v in os.environ.items() if not k.startswith("RLWIRE_FAULT")}
        started = time.monotonic()
        run = Watched(job, base, 1, plain)
        run.start()
        hang = watch(run, {})["hang"]
        run.leftovers()
        shutil.rmtree(run.ray_tmp, ignore_errors=True)
        final = run.run_dir / "checkpoints" / f"step_{STEPS}"
        ok = run.proc.returncode == 0 and not hang and (final / "COMPLETE").exists()
        state = actor_state(final) if ok else None
        self.runs.append(
            {
                "name": job.name,
                "rc": run.proc.returncode,
                "hang": hang,
                "seconds": round(time.monotonic() - started, 1),
            }  # fmt: skip
        )
        if ok and not self.keep:
            shutil.rmtree(base, ignore_errors=True)
        return state


def compare_model(
    trial: Trial, run_dir: Path, references: References, *, restarted: bool
) -> dict[str, Any]:
    """A completed trial's final model and optimizer state against the reference's:
    ``same_model`` (None: not compared), ``model_diff`` (the first differing entries, or
    why there was nothing to compare), ``regenerated_groups``, ``no_survivor`` and
    ``exact_expected`` (whether a difference is a failure)."""
    records = checks.step_records(run_dir / "metrics.jsonl")
    count, no_survivor = regenerated(run_dir, records)
    fields: dict[str, Any] = {
        "regenerated_groups": count,
        "no_survivor": no_survivor,
        "exact_expected": exact_expected(trial.mode, no_survivor, restarted),
    }
    reference = references.state(trial)
    final = run_dir / "checkpoints" / f"step_{STEPS}"
    if reference is None:
        return {**fields, "same_model": None, "model_diff": ["no reference: its run failed"]}
    if not (final / "COMPLETE").exists():
        return {**fields, "same_model": None, "model_diff": [f"no complete step_{STEPS}"]}
    differ = model_diff(actor_state(final), reference)
    more = [f"... {len(differ) - 3} more"] if len(differ) > 3 else []
    return {**fields, "same_model": not differ, "model_diff": differ[:3] + more}
