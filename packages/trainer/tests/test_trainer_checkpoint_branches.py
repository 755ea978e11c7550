"""Checkpoints survive every resume: a resume from an earlier step sets the later ones
aside (pruning and resume=auto then see the new branch only), and a step directory already
there stays until its replacement is complete."""

from __future__ import annotations

import types
from pathlib import Path

from rlwire.trainer.config.root import load_config
from rlwire.trainer.outputs.checkpoint import save_checkpoint
from rlwire.trainer.outputs.checkpoint_dirs import (
    completed_step,
    latest_checkpoint,
    prune_checkpoints,
    set_aside_checkpoints,
)


def _complete(run: Path, step: int, mark: str = "x") -> Path:
    directory = run / "checkpoints" / f"step_{step}"
    directory.mkdir(parents=True)
    (directory / "weights").write_text(mark)
    (directory / "COMPLETE").write_text(str(step))
    return directory


def test_a_resume_from_an_earlier_step_sets_the_later_branch_aside(tmp_path):
    # reproduced: 30 steps saved every 10, resumed from step_20 to 25 saving every 5 with
    # max_checkpoints_to_keep=1 left only the abandoned step_30 (the new step_25 pruned)
    for step in (10, 20, 30):
        _complete(tmp_path, step)
    resumed = tmp_path / "checkpoints" / "step_20"
    assert completed_step(resumed) == 20
    aside = set_aside_checkpoints(tmp_path, after=20)
    assert aside == tmp_path / "checkpoints.before-1"
    assert sorted(p.name for p in aside.iterdir()) == ["step_30"]
    _complete(tmp_path, 25)  # the new branch's save
    assert prune_checkpoints(tmp_path, keep=1) == [
        tmp_path / "checkpoints" / "step_10",
        tmp_path / "checkpoints" / "step_20",
    ]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_25"
    assert set_aside_checkpoints(tmp_path, after=25) is None  # nothing after it


def test_a_step_directory_is_replaced_only_once_its_replacement_is_complete(tmp_path):
    old = _complete(tmp_path, 5, "old")
    seen = []

    class Actor:
        class save:  # noqa: N801  (a Ray method's shape: .remote)
            @staticmethod
            def remote(directory: str) -> None:
                seen.append((old / "COMPLETE").exists())  # the old one intact meanwhile
                (Path(directory) / "weights").write_text("new")

    job = types.SimpleNamespace(
        config=load_config(),
        run_dir=tmp_path,
        actors=[Actor()],
        world=1,
        call=lambda refs, what: list(refs),
    )
    save_checkpoint(job, 5)
    assert seen == [True]
    assert (old / "weights").read_text() == "new" and completed_step(old) == 5
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_5"]


def test_the_run_lock_follows_no_link_and_truncates_nothing_it_points_to(tmp_path):
    import pytest

    from rlwire.trainer.errors import RunError
    from rlwire.trainer.outputs.run_lock import RunLock

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(precious)
    with pytest.raises(RunError, match=r"^trainer.output_dir: cannot take .*\.lock .*a link"):
        RunLock(run)
    assert precious.read_text() == "keep me\n"  # was truncated to the run's pid
    (run / ".lock").unlink()
    lock = RunLock(run)
    assert (run / ".lock").read_text() == f"{__import__('os').getpid()}\n"
    lock.release()


def test_an_export_is_flushed_then_swapped_in_whole(tmp_path, monkeypatch):
    """hf_model/ (and a checkpoint put in place): every file flushed before the swap, the
    target present at every moment (one exchange where the kernel has it), the old gone."""
    import os

    from rlwire.trainer.models.modeling import replace_directory

    target, staging = tmp_path / "hf_model", tmp_path / "hf_model.tmp"
    for folder, text in ((target, "old"), (staging, "new")):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "weights").write_text(text)
    real_fsync, flushed = os.fsync, []

    def spy(fd: int) -> None:
        flushed.append(
            (os.readlink(f"/proc/self/fd/{fd}"), (target / "sub" / "weights").read_text())
        )
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    replace_directory(staging, target)
    before_swap = {path for path, seen in flushed if seen == "old"}
    assert {str(staging / "sub" / "weights"), str(staging / "sub"), str(staging)} <= before_swap
    assert (str(tmp_path), "new") in flushed  # the swap itself flushed
    assert (target / "sub" / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
