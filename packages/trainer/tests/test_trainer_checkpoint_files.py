"""What a checkpoint's files may do: DCP's non-tensor entries read once, as tensors and plain
data; only files inside the checkpoint read; a checkpoint without a manifest refused unless
``trainer.checkpoint_manifest=warn``; every file flushed to disk before ``COMPLETE``.
Real DCP saves and loads in one process (no process group), no Ray job."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlwire.trainer.config.root import load_config
from rlwire.trainer.errors import RunError
from rlwire.trainer.outputs import checkpoint_reader
from rlwire.trainer.outputs.checkpoint import (
    read_trainer_state,
    save_actor,
    save_checkpoint,
    write_manifest,
    write_trainer_state,
)


@pytest.fixture(autouse=True)
def _one_rank():
    with warnings.catch_warnings():  # "no process group: saving/loading as one rank"
        warnings.simplefilter("ignore")
        yield


def _actor_state(fill: float) -> dict:
    """An engine's state as DCP sees it: tensors, and an optimizer's plain-data groups."""
    w = torch.arange(6.0).reshape(2, 3) * fill
    group = {"lr": 0.1 * fill, "betas": (0.9, 0.99), "foreach": None, "params": ["w"]}
    return {
        "model": {"w": w},
        "optimizer": {
            "state": {"w": {"step": torch.tensor(3.0 * fill), "exp_avg": w + 1}},
            "param_groups": [group],
        },
    }


def test_non_tensor_entries_are_read_once_with_weights_only(tmp_path, monkeypatch):
    """DCP's default planner read them again with ``torch.load(weights_only=False)``."""
    saved = _actor_state(1.0)
    checkpoint_reader.save(saved, tmp_path / "actor")
    entries = checkpoint_reader.SafeReader(tmp_path / "actor").read_metadata().storage_data
    real_load, calls = torch.load, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    state = _actor_state(0.0)
    checkpoint_reader.load(state, tmp_path / "actor")
    assert calls == [True] * len(entries)  # one read an entry, never weights_only=False
    assert len(entries) > 3  # the tensors and the groups' values (lr, betas, ...)
    torch.testing.assert_close(state["model"], saved["model"], atol=0, rtol=0)
    loaded, expected = state["optimizer"], saved["optimizer"]
    torch.testing.assert_close(loaded["state"], expected["state"], atol=0, rtol=0)
    assert loaded["param_groups"] == expected["param_groups"]


def _escaping(tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A checkpoint whose entry ``w`` reads a file outside it, ``how``; and that file."""
    actor = tmp_path / "actor"
    checkpoint_reader.save({"w": torch.arange(4.0)}, actor)
    outside = tmp_path / "outside.distcp"
    shutil.copy(actor / "__0_0.distcp", outside)  # a readable file: only the check refuses
    if how == "symlink":
        (actor / "__0_0.distcp").unlink()
        (actor / "__0_0.distcp").symlink_to(outside)
        return actor, outside
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(actor).read_metadata()  # our own file: plain pickle is fine
    relative = "../outside.distcp" if how == "parent" else str(outside)
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=relative)
        for index, info in metadata.storage_data.items()
    }
    (actor / ".metadata").write_bytes(pickle.dumps(metadata))
    return actor, outside


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_an_entry_outside_the_checkpoint_is_refused(tmp_path, how):
    good = tmp_path / "good"
    checkpoint_reader.save({"w": torch.arange(4.0), "step": 7}, good)
    state = {"w": torch.zeros(4), "step": 0}
    checkpoint_reader.load(state, good)  # the check passes a checkpoint's own files
    assert torch.equal(state["w"], torch.arange(4.0)) and state["step"] == 7
    actor, outside = _escaping(tmp_path, how)
    with pytest.raises(RunError) as err:
        checkpoint_reader.load({"w": torch.zeros(4)}, actor)
    assert str(err.value) == (
        f"{actor}: entry 'w' of its .metadata reads {outside.resolve()}, outside the "
        "checkpoint's directory; refused (a checkpoint reads its own files only)"
    )


def _saved(tmp_path: Path) -> Path:
    directory = tmp_path / "step_3"
    directory.mkdir()
    state = {"step": 3, "mode": "colocated", "actor_world_size": 2, "strategy": "fsdp2"}
    write_trainer_state(directory, {**state, "lora_rank": 0})
    return directory


def test_a_checkpoint_without_a_manifest_is_refused_unless_warn(tmp_path, capsys):
    directory = _saved(tmp_path)
    write_manifest(directory)
    assert read_trainer_state(directory, load_config())["step"] == 3
    (directory / "MANIFEST.json").unlink()
    with pytest.raises(RunError) as err:
        read_trainer_state(directory, load_config())  # the default: require
    assert str(err.value) == (
        f"trainer.resume: {directory} has no MANIFEST.json, so its files cannot be checked "
        "for damage; trainer.checkpoint_manifest=warn resumes from it unchecked, or resume "
        "from another checkpoint (trainer.resume=PATH) or start again"
    )
    capsys.readouterr()
    warn = load_config(overrides=["trainer.checkpoint_manifest=warn"])
    assert read_trainer_state(directory, warn)["step"] == 3
    assert capsys.readouterr().err == (
        f"rlwire-train: warning: {directory} has no MANIFEST.json: resuming without checking "
        "its files for damage (trainer.checkpoint_manifest=warn)\n"
    )
    with pytest.raises(ValueError, match=r"trainer.checkpoint_manifest.*use 'require' or 'warn'"):
        load_config(overrides=["trainer.checkpoint_manifest=ignore"])


def test_every_file_and_directory_is_flushed_before_complete(tmp_path, monkeypatch):
    """A power loss after ``COMPLETE`` must not leave a file it vouches for short."""
    engine = SimpleNamespace(state=lambda: {"w": torch.arange(4.0), "step": 7})
    actor = SimpleNamespace(save=SimpleNamespace(remote=lambda d: save_actor(engine, Path(d), 0)))
    job = SimpleNamespace(
        config=load_config(),
        run_dir=tmp_path.resolve(),
        actors=[actor],
        world=1,
        call=lambda calls, what: calls,  # the "remote" calls ran as they were made
    )
    target = job.run_dir / "checkpoints" / "step_3"
    real_fsync, synced = os.fsync, []

    def spy(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (target / "COMPLETE").exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    save_checkpoint(job, 3, queue={})
    before = {path for path, complete in synced if not complete}
    files = [p for p in target.rglob("*") if p.is_file() and p.name != "COMPLETE"]
    assert {p.name for p in files} >= {"__0_0.distcp", ".metadata", "actor_rank0.pt"}
    assert {p.name for p in files} >= {"trainer_state.json", "MANIFEST.json"}
    # written as step_3.partial, renamed step_3 once complete: flushed under that name
    partial = target.with_name("step_3.partial")
    written = [partial / p.relative_to(target) for p in files]
    directories = [partial, target.parent, partial / "actor", partial / "rng"]
    assert {str(p) for p in written + directories} <= before
    assert str(partial / "COMPLETE.partial") in before  # COMPLETE: written, flushed, renamed
    assert (str(partial), False) in synced  # and that rename flushed
    assert (str(target.parent), True) in synced  # then the rename into place, flushed
    assert sorted(p.name for p in target.iterdir()) == [
        "COMPLETE",
        "MANIFEST.json",
        "actor",
        "rng",
        "trainer_state.json",
    ]
    assert (target / "COMPLETE").read_text() == "3"
