"""Checkpoints survive every resume: a resume from an earlier step sets the later ones
aside (pruning and resume=auto then see the new branch only), and a step directory already
there stays until its replacement is complete."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

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


def _saved(run: Path, step: int, config, *, identity: dict | None = None) -> Path:
    """A checkpoint as a save leaves it: trainer_state.json (``identity``: the run it
    records), MANIFEST.json, COMPLETE."""
    from rlwire.trainer.outputs.checkpoint import (
        finish_checkpoint,
        run_identity,
        write_trainer_state,
    )

    directory = run / "checkpoints" / f"step_{step}"
    directory.mkdir(parents=True)
    (directory / "weights").write_text(f"weights of step {step}")
    actor = config.actor
    state = {"step": step, "mode": config.trainer.mode, "actor_world_size": 1}
    state |= {"strategy": actor.strategy, "lora_rank": actor.lora.rank}
    write_trainer_state(directory, {**state, "run": identity or run_identity(config)})
    finish_checkpoint(directory, step)
    return directory


def _listing(run: Path) -> dict[str, list[str]]:
    return {
        d.name: sorted(p.name for p in d.iterdir())
        for d in sorted(run.iterdir())
        if d.name.startswith("checkpoints")
    }


def _resume_config(run: Path, resume: str):
    return load_config(overrides=[f"trainer.output_dir={run}", f"trainer.resume={resume}"])


def _another_model(directory: Path) -> None:
    from rlwire.trainer.outputs.checkpoint import write_manifest

    state = directory / "trainer_state.json"
    text = state.read_text().replace('"model.path": "tiny"', '"model.path": "/another/model"')
    assert text != state.read_text()
    state.write_text(text)
    write_manifest(directory)  # consistent: only the model differs


def _damaged(directory: Path) -> None:
    (directory / "weights").write_text("flipped")


@pytest.mark.parametrize(
    ("spoil", "refusal"),
    [
        (_another_model, r"was written for another run: model.path '/another/model'"),
        (_damaged, r"weights differs from the checkpoint's MANIFEST.json"),
    ],
    ids=["another model", "a damaged file"],
)
def test_a_refused_resume_moves_no_checkpoint_aside(tmp_path, spoil, refusal):
    """Reproduced: ``resume=PATH`` of a checkpoint of another model (or a damaged one) set
    the later steps aside, then was refused; the next ``resume=auto`` silently went on from
    the older step."""
    from rlwire.trainer.driver import resume_point
    from rlwire.trainer.errors import RunError

    run = tmp_path / "run"
    ours = load_config(overrides=[f"trainer.output_dir={run}"])
    for step in (10, 20, 30):
        _saved(run, step, ours)
    spoil(run / "checkpoints" / "step_20")
    before = _listing(run)
    config = _resume_config(run, str(run / "checkpoints" / "step_20"))
    with pytest.raises(RunError, match=rf"^trainer.resume: .*step_20.*{refusal}"):
        resume_point(config, run)
    assert _listing(run) == before == {"checkpoints": ["step_10", "step_20", "step_30"]}
    assert latest_checkpoint(run) == run / "checkpoints" / "step_30"


def test_a_resume_sets_the_later_branch_aside_even_when_complete_records_no_step(tmp_path, capsys):
    """``COMPLETE`` without a step (empty: written by hand, or by an older writer) skipped
    the set-aside: the abandoned step_30 stayed the newest, for pruning and resume=auto.
    The step is the one the run continues from, its trainer_state.json's."""
    from rlwire.trainer.driver import resume_point

    run = tmp_path / "run"
    ours = load_config(overrides=[f"trainer.output_dir={run}"])
    for step in (10, 20, 30):
        _saved(run, step, ours)
    resumed = run / "checkpoints" / "step_20"
    (resumed / "COMPLETE").write_text("")
    assert completed_step(resumed) is None
    found = resume_point(_resume_config(run, str(resumed)), run)
    assert found is not None and found[0] == resumed and found[1]["step"] == 20
    assert _listing(run) == {
        "checkpoints": ["step_10", "step_20"],
        "checkpoints.before-1": ["step_30"],
    }
    assert capsys.readouterr().err == (
        f"rlwire-train: trainer.resume={resumed}: the checkpoints after step 20 are moved to "
        f"{run / 'checkpoints.before-1'}\n"
    )


def test_a_resume_from_another_directory_sets_every_checkpoint_here_aside(tmp_path):
    """A checkpoint outside ``checkpoints/`` starts another lineage: this directory's
    checkpoints, of its earlier run, are set aside whole (pruning counted the ones at or
    before the step as the new run's and removed them)."""
    from rlwire.trainer.driver import resume_point

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    ours = load_config(overrides=[f"trainer.output_dir={run}"])
    for step in (10, 30):
        _saved(run, step, ours)
    source = _saved(elsewhere, 20, ours)
    found = resume_point(_resume_config(run, str(source)), run)
    assert found is not None and found[0] == source
    assert _listing(run) == {"checkpoints.before-1": ["step_10", "step_30"]}
    _complete(run, 25)
    assert prune_checkpoints(run, keep=1) == []
    assert _listing(run) == {
        "checkpoints": ["step_25"],
        "checkpoints.before-1": ["step_10", "step_30"],
    }


def test_pruning_that_cannot_remove_a_folder_warns_and_never_ends_the_run(
    tmp_path, monkeypatch, caplog
):
    """An ``rmtree`` failure while pruning (a file held open on a network filesystem, a
    permission) ended the run after a complete save; now the folder stays, one warning
    names it, and the next pruning tries it again. Set-aside folders are never pruned."""
    import shutil

    _complete(tmp_path, 10)
    (tmp_path / "checkpoints.before-1" / "step_5").mkdir(parents=True)
    (tmp_path / "checkpoints.before-1" / "step_5" / "COMPLETE").write_text("5")
    _complete(tmp_path, 20)
    stuck = tmp_path / "checkpoints" / "step_10"
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path) == stuck:
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    job = types.SimpleNamespace(
        config=load_config(overrides=["trainer.max_checkpoints_to_keep=1"]),
        run_dir=tmp_path,
        actors=[],
        world=1,
        call=lambda refs, what: list(refs),
    )
    with caplog.at_level("WARNING", logger="rlwire.trainer"):
        save_checkpoint(job, 30)  # complete, then pruned
    assert completed_step(tmp_path / "checkpoints" / "step_30") == 30
    assert [r.getMessage() for r in caplog.records] == [
        f"pruning checkpoints: {stuck} not removed ([Errno 13] Permission denied: "
        f"'{stuck}'); the run goes on"
    ]
    assert _listing(tmp_path) == {
        "checkpoints": ["step_10", "step_30"],
        "checkpoints.before-1": ["step_5"],
    }
    monkeypatch.setattr(shutil, "rmtree", real)
    assert prune_checkpoints(tmp_path, keep=1) == [stuck]  # tried again: removed
    assert _listing(tmp_path)["checkpoints"] == ["step_30"]


def test_a_resumed_runs_metrics_are_rewritten_beside_and_renamed_over(tmp_path, monkeypatch):
    """``metrics.jsonl`` was truncated and written again in place on resume: a crash
    meanwhile (here: the write fails) lost every line. Now the kept lines go to a new file
    renamed over the old one."""
    import json

    from rlwire.trainer.outputs.summary import drop_metrics_after

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "reward_mean": s / 10}) for s in (1, 2, 3, 4)]
    path.write_text("".join(line + "\n" for line in lines))
    written = path.read_bytes()
    real_open = Path.open

    class Crash:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            raise OSError(28, "No space left on device")

    def failing_open(self, mode="r", *args, **kwargs):
        file = real_open(self, mode, *args, **kwargs)
        return Crash(file) if "w" in mode else file

    monkeypatch.setattr(Path, "open", failing_open)
    with pytest.raises(OSError, match="No space left"):
        drop_metrics_after(path, 2)
    assert path.read_bytes() == written  # whole
    monkeypatch.setattr(Path, "open", real_open)
    drop_metrics_after(path, 2)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    drop_metrics_after(tmp_path / "none.jsonl", 2)  # a fresh run's: nothing to do
    assert not (tmp_path / "none.jsonl").exists()
