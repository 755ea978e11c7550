"""Checkpoints that resume anywhere: the layout of ``checkpoints/step_<n>/`` and what each
process saves and restores.

::

    step_<n>/
      actor/                  torch.distributed.checkpoint (DCP): the actor engine's model and
                              optimizer state under world-size-independent keys, one file per
                              rank that held a shard, resharded on load to any world size
      rng/actor_rank<r>.pt    actor rank r's RNG states (torch CPU and CUDA, Python's)
      trainer_state.json      format, step (= the weight version), the actor's world size,
                              strategy and LoRA rank, the mode, what the run trained (model,
                              data source, advantage estimator: a resume must match it);
                              fully async: the data position and the prompt groups started
                              but not trained
      MANIFEST.json           every file above with its size and SHA-256: a file damaged
                              since (a flipped byte in a tensor loads silently otherwise) is
                              named when the checkpoint is resumed; a checkpoint without one
                              is refused unless trainer.checkpoint_manifest=warn
      COMPLETE                written last, by the driver, once every rank returned and every
                              file above and the directories are flushed to disk (fsync)

A save that is cut off (a process killed while writing) leaves a directory without
``COMPLETE``: it is never resumed from, and the next save of that step replaces it.

What resumes where: the weights and the optimizer state at any actor world size (FSDP2,
FSDP1 and one unwrapped rank share one layout: ``torch.distributed.checkpoint.state_dict``;
Megatron saves full per-parameter Adam states under Hugging Face names); the RNG states at
the world size they were saved with (at another, every rank reseeds from ``trainer.seed``
and the step, and the log says so). The rollout engines and the driver keep no RNG between
steps: each generation call is seeded from ``trainer.seed``, the step and the worker, and the
data position follows the step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from ..errors import RunError
from ..models.modeling import fsync_path as _fsync
from ..models.modeling import replace_directory
from .checkpoint_dirs import prune_checkpoints

__all__ = [
    "FORMAT",
    "check_manifest",
    "finish_checkpoint",
    "load_actor",
    "load_checkpoint",
    "read_trainer_state",
    "run_identity",
    "save_actor",
    "save_checkpoint",
    "write_manifest",
    "write_trainer_state",
]

FORMAT = 2
"""The layout above. Format 1 (``actor_rank<r>.pt``: each rank's own shard, loadable only at
the world size that wrote it) is refused with a line that says so."""

_STATE = "trainer_state.json"
_MANIFEST = "MANIFEST.json"
_ELSEWHERE = "resume from another checkpoint (trainer.resume=PATH) or start again"

log = logging.getLogger("rlwire.trainer")


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


def write_manifest(directory: Path) -> None:
    """``MANIFEST.json``: every file of checkpoint ``directory`` (before ``COMPLETE``) with
    its size and SHA-256."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != _MANIFEST)
    entries = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _digest(p)}
        for p in files
    }
    (directory / _MANIFEST).write_text(json.dumps(entries, indent=1) + "\n")


def check_manifest(directory: Path, *, missing: str) -> None:
    """One line naming the first file of ``directory`` that is missing or differs from its
    ``MANIFEST.json``. A checkpoint without one (written before manifests, or not by rlwire)
    is refused if ``missing`` (``trainer.checkpoint_manifest``) is ``require``; ``warn``
    says so in one line and takes it unchecked."""
    path = directory / _MANIFEST
    if not path.exists():
        if missing == "require":
            raise RunError(
                f"trainer.resume: {directory} has no {_MANIFEST}, so its files cannot be "
                "checked for damage; trainer.checkpoint_manifest=warn resumes from it "
                f"unchecked, or {_ELSEWHERE}"
            )
        print(  # on the terminal only: the run's train.log is not open yet
            f"rlwire-train: warning: {directory} has no {_MANIFEST}: resuming without checking "
            "its files for damage (trainer.checkpoint_manifest=warn)",
            file=sys.stderr,
        )
        return
    try:
        entries = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunError(f"trainer.resume: {path} is damaged ({err}); {_ELSEWHERE}") from None
    root = directory.resolve()
    if not isinstance(entries, dict) or not all(
        isinstance(name, str)
        and isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("sha256"), str)
        for name, entry in entries.items()
    ):
        raise RunError(
            f"trainer.resume: {path} is damaged (not a mapping of file -> bytes and sha256); "
            f"{_ELSEWHERE}"
        )
    for name, entry in entries.items():
        file = directory / name
        if not file.resolve().is_relative_to(root):  # ../, an absolute path, a link out
            raise RunError(
                f"trainer.resume: {path} names {name!r}, outside the checkpoint; refused"
            )
        if not file.is_file():
            raise RunError(f"trainer.resume: {file} is missing; {_ELSEWHERE}")
        if file.stat().st_size != entry["bytes"] or _digest(file) != entry["sha256"]:
            raise RunError(
                f"trainer.resume: {file} differs from the checkpoint's MANIFEST.json (the "
                f"file is damaged); {_ELSEWHERE}"
            )


def finish_checkpoint(directory: Path, step: int, into: Path | None = None) -> None:
    """The driver's end of a save of ``step`` to ``directory``, once every rank returned and
    ``trainer_state.json`` is written: ``MANIFEST.json``; every file and directory of the
    checkpoint (and its entry in ``checkpoints/``) flushed to disk; then ``COMPLETE``,
    written to a temporary name, flushed, renamed and the rename flushed. The kernel writes
    pages back in any order: without the flushes, a power loss after the save could leave
    ``COMPLETE`` on disk and a file it vouches for empty or short. (The ranks' files are
    written in their processes; an ``fsync`` from here flushes them on the same
    filesystem.) ``into``: then renamed there (a save written as ``step_<n>.partial``),
    the directory it replaces removed only after."""
    write_manifest(directory)
    for path in sorted(directory.rglob("*"), reverse=True):  # files, then their directories
        if path.is_file() or path.is_dir():
            _fsync(path)
    _fsync(directory)
    _fsync(directory.parent)
    partial = directory / "COMPLETE.partial"
    with partial.open("w") as file:
        file.write(str(step))
        file.flush()
        os.fsync(file.fileno())
    partial.replace(directory / "COMPLETE")
    _fsync(directory)
    if into is not None:  # a save written beside: renamed into place, the old one gone after
        replace_directory(directory, into)
        _fsync(into.parent)


def write_trainer_state(directory: Path, state: dict[str, Any]) -> None:
    """The driver's part of a checkpoint (before ``COMPLETE``)."""
    (directory / _STATE).write_text(json.dumps({"format": FORMAT, **state}, indent=1) + "\n")


def read_trainer_state(directory: Path, config) -> dict[str, Any]:
    """The driver's part of checkpoint ``directory``, checked against the run's ``config``:
    one line naming the problem if this run cannot continue from it."""
    path = directory / _STATE
    if not path.exists():
        if any(directory.glob("actor_rank*.pt")):
            raise RunError(
                f"trainer.resume: {directory} holds per-rank files (actor_rank<r>.pt), the "
                "checkpoint format of rlwire-trainer before world-size-independent checkpoints; "
                "this version cannot read them: resume it with the version that wrote it, or "
                "start again (trainer.resume=never)"
            )
        raise RunError(f"trainer.resume: {directory} has no {_STATE}: not an rlwire checkpoint")
    check_manifest(directory, missing=config.trainer.checkpoint_manifest)
    try:
        state = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunError(f"trainer.resume: {path} is damaged ({err}); {_ELSEWHERE}") from None
    if state.get("format") != FORMAT:
        raise RunError(
            f"trainer.resume: {directory} is checkpoint format {state.get('format')!r}; this "
            f"version reads format {FORMAT}"
        )
    identity = state.get("run")  # none in a checkpoint older than the check
    if identity is not None and not config.trainer.resume_anyway:
        ours = run_identity(config)
        differs = [
            f"{k} {v!r} (now {ours.get(k)!r})" for k, v in identity.items() if ours.get(k) != v
        ]
        if differs:
            raise RunError(
                f"trainer.resume: {directory} was written for another run: {', '.join(differs)}. "
                "For a new run choose another trainer.output_dir or trainer.experiment_name; "
                "to continue from it anyway, set trainer.resume_anyway=true"
            )
    actor = config.actor
    saved, now = (state["strategy"], state["lora_rank"]), (actor.strategy, actor.lora.rank)
    if saved != now:
        raise RunError(
            f"trainer.resume: {directory} was saved with actor.strategy={saved[0]} and "
            f"actor.lora.rank={saved[1]}; this run has {now[0]} and {now[1]}: resume with the "
            "strategy and LoRA rank it was saved with (the world size may change)"
        )
    return state


def run_identity(config) -> dict[str, Any]:
    """What a checkpoint was trained for, which a resume must match: the model, the data
    source (local paths resolved, so a relative and an absolute name agree) and the
    advantage estimator."""

    def where(value: Any) -> Any:
        if isinstance(value, list):
            return [where(v) for v in value]
        path = Path(value).expanduser()
        return str(path.resolve()) if value != "tiny" and path.exists() else value

    return {
        "model.path": where(config.model.path),
        "data.source": where(config.data.source),
        "algorithm.adv_estimator": config.algorithm.adv_estimator,
    }


def save_actor(engine, directory: Path, rank: int) -> None:
    """Actor rank ``rank``'s part of a checkpoint: its share of the engine's state through
    DCP (a collective: every rank calls it) and its RNG states."""
    from . import checkpoint_reader  # imports DCP: only when a checkpoint is written

    checkpoint_reader.save(engine.state(), directory / "actor")
    rng = directory / "rng"
    rng.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
        },
        rng / f"actor_rank{rank}.pt",
    )


def load_rng(path: Path) -> dict[str, Any]:
    """A rank's saved RNG states, read as tensors and plain data only (``weights_only``): a
    file that holds anything else (a pickle that would run code) is refused, naming it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        from .checkpoint_reader import refusal  # imports DCP: only when a file is refused

        raise RunError(f"{path}: {refusal(err)}") from None


def load_actor(engine, directory: Path, rank: int, *, same_world: bool, reseed: int) -> None:
    """Restore the engine's state from ``directory`` (resharded to this group: a collective)
    and this rank's RNG states if the world size is the one saved (``same_world``); at
    another, every RNG is seeded with ``reseed`` (the same on every rank, as at start)."""
    from . import checkpoint_reader

    state = engine.state()  # the layout to fill: DCP reads each rank's share into it
    checkpoint_reader.load(state, directory / "actor")
    engine.load_state(state)
    if not same_world:
        random.seed(reseed)
        torch.manual_seed(reseed)
        return
    saved = load_rng(directory / "rng" / f"actor_rank{rank}.pt")
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    random.setstate(saved["python"])


def save_checkpoint(job, done: int, **state: Any) -> None:
    """``checkpoints/step_<done>`` for ``job`` (a :class:`rlwire.trainer.runtime.job.Job`): every
    actor rank's part, then ``trainer_state.json`` (with ``state``), then the manifest, the
    flush to disk and ``COMPLETE`` (:func:`finish_checkpoint`); then the pruning of
    ``trainer.max_checkpoints_to_keep``. A directory of that step already there (a cut-off
    save, or one of a run resumed earlier) is replaced."""
    config = job.config
    final = job.run_dir / "checkpoints" / f"step_{done}"
    # written beside, then renamed into place: a complete step directory already there (a
    # run resumed from an earlier step) stays until its replacement is complete
    target = final.with_name(f"{final.name}.partial")
    shutil.rmtree(target, ignore_errors=True)  # a save of this step cut off earlier
    target.mkdir(parents=True)
    job.call([a.save.remote(str(target)) for a in job.actors], "saving")
    actor = config.actor
    write_trainer_state(
        target,
        {
            "step": done,
            "mode": config.trainer.mode,
            "actor_world_size": job.world,
            "strategy": actor.strategy,
            "lora_rank": actor.lora.rank,
            "run": run_identity(config),
            **state,
        },
    )
    finish_checkpoint(target, done, into=final)
    keep = config.trainer.max_checkpoints_to_keep
    if keep is not None:
        prune_checkpoints(job.run_dir, keep)


def load_checkpoint(job, checkpoint: Path, saved: dict[str, Any]) -> None:
    """Load ``checkpoint`` (its trainer state ``saved``) on every actor rank of ``job``,
    resharded to its world size; what changed is logged."""
    step = saved["step"]
    same_world = saved["actor_world_size"] == job.world
    loads = [a.load.remote(str(checkpoint), same_world=same_world, step=step) for a in job.actors]
    job.call(loads, "loading the checkpoint")
    log.info("resumed from %s at step %d", checkpoint, step)
    mode = job.config.trainer.mode
    pending = len(saved.get("queue", {}).get("pending", []))
    if pending and mode != "fully_async":
        warning = (
            f"{checkpoint} is a fully_async checkpoint with {pending} prompt groups started "
            f"but not trained; trainer.mode={mode} goes on from step {step}'s batch and does "
            "not generate them again"
        )
        log.warning("%s", warning)
        print(f"rlwire-train: warning: {warning}", file=sys.stderr)
    if not same_world:
        log.info(
            "resumed at actor.world_size=%d from a checkpoint saved at %d: the weights and the "
            "optimizer state resharded; the actor ranks' RNGs reseeded from trainer.seed + %d",
            job.world,
            saved["actor_world_size"],
            step,
        )
