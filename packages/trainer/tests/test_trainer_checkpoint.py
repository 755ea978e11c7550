"""World-size-independent checkpoints: actor engines save at one world size and load at
another (gloo ranks), bit for bit; what a run refuses to resume from."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from reshard import assert_resharded, save_or_load  # this folder: pytest puts it on sys.path
from trainer_cli import FSDP2_REFERENCE, train_cli

from rlwire.trainer.config.root import load_config
from rlwire.trainer.errors import RunError
from rlwire.trainer.outputs.checkpoint import (
    FORMAT,
    read_trainer_state,
    write_manifest,
    write_trainer_state,
)


@pytest.fixture(scope="module")
def fsdp_checkpoints(tmp_path_factory) -> Path:
    """FSDP2, FSDP1 and FSDP2 with LoRA saved on 2 ranks, loaded on 1 (and FSDP2 on 4)."""
    directory = tmp_path_factory.mktemp("checkpoints")
    save_or_load(2, "save", directory, "fsdp2", "fsdp", "fsdp2_lora")
    save_or_load(1, "load", directory, "fsdp2", "fsdp", "fsdp2_lora")
    save_or_load(4, "load", directory, "fsdp2")
    return directory


@pytest.mark.parametrize(
    ("case", "loaded_at"), [("fsdp2", 1), ("fsdp2", 4), ("fsdp", 1), ("fsdp2_lora", 1)]
)
def test_a_checkpoint_saved_on_two_ranks_loads_on_another_number(fsdp_checkpoints, case, loaded_at):
    assert_resharded(fsdp_checkpoints, case, 2, loaded_at)
    # one file per rank that held a shard, and DCP's metadata: nothing per world size to match
    files = sorted(p.name for p in (fsdp_checkpoints / case / "actor").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_lora_checkpoints_hold_the_adapter_only(fsdp_checkpoints):
    from torch.distributed.checkpoint import FileSystemReader

    from rlwire.trainer.models.lora import is_adapter

    def saved_keys(case: str) -> list[str]:
        metadata = FileSystemReader(fsdp_checkpoints / case / "actor").read_metadata()
        return list(metadata.state_dict_metadata)

    model = [k for k in saved_keys("fsdp2_lora") if k.startswith("model.")]
    assert model and all(is_adapter(k) for k in model)  # not even the tied output layer
    optimizer = [k for k in saved_keys("fsdp2_lora") if k.startswith("optimizer.state.")]
    assert optimizer and all(is_adapter(k) for k in optimizer)

    def size(case: str) -> int:
        return sum(p.stat().st_size for p in (fsdp_checkpoints / case / "actor").iterdir())

    assert size("fsdp2_lora") < size("fsdp2") / 2


def _state(tmp_path: Path, **fields) -> Path:
    directory = tmp_path / "step_3"
    directory.mkdir()
    write_trainer_state(
        directory,
        {
            "step": 3,
            "mode": "colocated",
            "actor_world_size": 2,
            "strategy": "fsdp2",
            "lora_rank": 0,
            **fields,
        },
    )
    write_manifest(directory)
    return directory


def test_trainer_state_round_trip_and_refusals(tmp_path):
    config = load_config()
    directory = _state(tmp_path)
    assert read_trainer_state(directory, config)["format"] == FORMAT
    # another strategy or LoRA rank: one line, before anything starts
    with pytest.raises(RunError, match=r"saved with actor.strategy=fsdp2 and actor.lora.rank=0;"):
        read_trainer_state(directory, load_config(overrides=["actor.strategy=fsdp"]))
    with pytest.raises(RunError, match=r"this run has fsdp2 and 8"):
        read_trainer_state(directory, load_config(overrides=["actor.lora.rank=8"]))
    (directory / "trainer_state.json").write_text(json.dumps({"format": 99}))
    write_manifest(directory)
    with pytest.raises(RunError, match="is checkpoint format 99; this version reads format 2"):
        read_trainer_state(directory, config)


def test_a_damaged_checkpoint_file_is_named_before_anything_loads(tmp_path):
    """A flipped byte in a tensor file loads silently (the fault campaign found DCP's shard and
    an RNG file resumed with damage); the manifest names the file first."""
    config = load_config()
    directory = _state(tmp_path)
    (directory / "rng").mkdir()
    (directory / "rng" / "actor_rank0.pt").write_bytes(bytes(range(256)))
    write_manifest(directory)
    manifest = json.loads((directory / "MANIFEST.json").read_text())
    assert sorted(manifest) == ["rng/actor_rank0.pt", "trainer_state.json"]
    assert manifest["rng/actor_rank0.pt"]["bytes"] == 256
    assert read_trainer_state(directory, config)["format"] == FORMAT
    damaged = bytearray(range(256))
    damaged[100] ^= 0xFF  # same size, one byte changed
    (directory / "rng" / "actor_rank0.pt").write_bytes(bytes(damaged))
    with pytest.raises(RunError) as err:
        read_trainer_state(directory, config)
    assert str(err.value) == (
        f"trainer.resume: {directory / 'rng' / 'actor_rank0.pt'} differs from the checkpoint's "
        "MANIFEST.json (the file is damaged); resume from another checkpoint "
        "(trainer.resume=PATH) or start again"
    )
    (directory / "MANIFEST.json").unlink()  # a checkpoint from before manifests: taken with
    unchecked = load_config(overrides=["trainer.checkpoint_manifest=warn"])  # warn only
    (directory / "trainer_state.json").write_bytes(b'{"format": 2, "step": \xdd}')
    with pytest.raises(RunError, match=r"trainer_state.json is damaged \(.*\); resume from"):
        read_trainer_state(directory, unchecked)


class _RunsCode:
    """What a checkpoint from elsewhere could hold: unpickling it calls ``_ran``."""

    def __reduce__(self):
        return (_ran, ())


RAN: list[bool] = []


def _ran():
    RAN.append(True)
    return {}


def test_rng_states_are_read_without_running_code(tmp_path):
    import random

    import torch

    from rlwire.trainer.outputs.checkpoint import load_rng

    good = tmp_path / "actor_rank0.pt"
    state = {"torch": torch.get_rng_state(), "cuda": [], "python": random.getstate()}
    torch.save(state, good)
    loaded = load_rng(good)
    assert torch.equal(loaded["torch"], state["torch"]) and loaded["python"] == state["python"]
    bad = tmp_path / "actor_rank1.pt"
    torch.save({"torch": torch.get_rng_state(), "python": _RunsCode()}, bad)
    with pytest.raises(RunError) as err:
        load_rng(bad)
    assert str(err.value).startswith(
        f"{bad}: holds objects other than tensors and plain data; refused"
    )
    assert RAN == []  # nothing ran


def test_dcp_metadata_is_read_without_running_code(fsdp_checkpoints, tmp_path):
    """Every checkpoint the engines wrote reads the same through the safe reader (and the
    loads above went through it); a .metadata naming anything else is refused, unrun."""
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    from rlwire.trainer.outputs.checkpoint_reader import SafeReader, load

    for case in ("fsdp2", "fsdp", "fsdp2_lora"):
        actor = fsdp_checkpoints / case / "actor"
        safe, plain = SafeReader(actor).read_metadata(), FileSystemReader(actor).read_metadata()
        assert safe.state_dict_metadata == plain.state_dict_metadata
        assert safe.storage_data == plain.storage_data and safe.storage_data
    bad = tmp_path / "actor"
    shutil.copytree(fsdp_checkpoints / "fsdp2" / "actor", bad)
    metadata = FileSystemReader(bad).read_metadata()
    metadata.planner_data = _RunsCode()  # what a .metadata from elsewhere could hold
    (bad / ".metadata").write_bytes(pickle.dumps(metadata))
    refusal = (
        f"{bad / '.metadata'}: names {__name__}._ran, which DCP's metadata never holds; "
        "refused (a checkpoint must not run code when it is loaded)"
    )
    with pytest.raises(RunError) as err:
        SafeReader(bad).read_metadata()
    assert str(err.value) == refusal
    with pytest.raises(RunError) as err:  # the same line through a load (DCP quoted it)
        load({}, bad)
    assert str(err.value) == refusal
    assert RAN == []  # nothing ran


def test_dcp_values_other_than_tensors_are_read_as_plain_data_only(tmp_path):
    """DCP's default planner torch.loads non-tensor entries with weights_only=False."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from rlwire.trainer.outputs.checkpoint_reader import SafeLoadPlanner, SafeReader, load, save

    plain = {"step": 7, "betas": (0.9, 0.99), "foreach": None}  # as in param_groups
    with warnings.catch_warnings():  # "no process group: saving as one rank"
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0), **plain}, checkpoint_id=tmp_path / "good")
        dcp.save({"w": torch.arange(4.0), "hook": _RunsCode()}, checkpoint_id=tmp_path / "bad")
        state = {"w": torch.zeros(4), "step": 0, "betas": (0.0, 0.0), "foreach": False}
        dcp.load(state, storage_reader=SafeReader(tmp_path / "good"), planner=SafeLoadPlanner())
        assert torch.equal(state.pop("w"), torch.arange(4.0)) and state == plain
        with pytest.raises(RunError) as err:
            load({"w": torch.zeros(4), "hook": None}, tmp_path / "bad")
        assert str(err.value) == (
            "checkpoint entry 'hook': holds objects other than tensors and plain data; refused "
            "(a checkpoint must not run code when it is loaded): Unsupported global: GLOBAL "
            f"{__name__}._ran was not an allowed global by default. Please use "
            f"`torch.serialization.add_safe_globals([{__name__}._ran])` or the "
            f"`torch.serialization.safe_globals([{__name__}._ran])` context manager to allowlist "
            "this global if you trust this class/function."
        )
        (tmp_path / "full").write_text("")  # a file where the checkpoint's directory goes
        with pytest.raises(RunError) as err:  # a failed write: one line, the cause first
            save({"w": torch.arange(4.0)}, tmp_path / "full" / "actor")
        assert str(err.value).startswith(f"{tmp_path / 'full' / 'actor'}: cannot be written (")
        assert "Error" in str(err.value) and "\n" not in str(err.value)
        (tmp_path / "good" / "__0_0.distcp").write_bytes(b"damaged")
        with pytest.raises(RunError, match=r"cannot be read \(.*\); is the file damaged\?$"):
            load({"w": torch.zeros(4), "step": 0}, tmp_path / "good")
    assert RAN == []  # nothing ran


def test_a_checkpoint_from_before_this_format_is_refused_with_the_reason(tmp_path):
    old = tmp_path / "step_2"
    old.mkdir()
    (old / "actor_rank0.pt").write_bytes(b"per-rank state")
    (old / "COMPLETE").write_text("2")
    with pytest.raises(RunError) as err:
        read_trainer_state(old, load_config())
    assert str(err.value) == (
        f"trainer.resume: {old} holds per-rank files (actor_rank<r>.pt), the checkpoint "
        "format of rlwire-trainer before world-size-independent checkpoints; this version "
        "cannot read them: resume it with the version that wrote it, or start again "
        "(trainer.resume=never)"
    )


def untimed(record: dict) -> dict:
    """A metrics line without what depends on the clock, or on how many syncs the process
    made before (the engine's delta density: the first delta after start-up is dense)."""
    clocked = (
        "time_",
        "wait_for_samples_s",
        "rollout_paused_s",
        "rollout_commit_s",
        "weight_sync_delta_density",
    )
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(clocked) and not k.endswith(("_per_s", "_gbps"))
    }


@pytest.mark.smoke  # the default selection's one job (conftest)
@pytest.mark.floor
def test_a_resumed_run_continues_bit_for_bit(
    fsdp2_reference_run, fsdp2_reference, ray_cluster, tmp_path
):
    """3 steps, against 1 step then resumed to 3 (the same world size): the same metrics
    for steps 2 and 3, digests of the weights each step included, and the same final
    weights. What this needs is in the checkpoint: weights, AdamW's state and step, every
    actor rank's RNGs; the data and the sampling seeds follow the step."""
    step_1 = fsdp2_reference_run / "checkpoints" / "step_1"
    resumed, _ = train_cli(
        tmp_path / "run",
        *FSDP2_REFERENCE,
        "trainer.steps=3",
        f"trainer.resume_from_path={step_1}",  # verl's key
        cluster=ray_cluster,
    )
    assert [r["step"] for r in resumed] == [2, 3]
    assert [untimed(r) for r in resumed] == [untimed(r) for r in fsdp2_reference[1:]]
    assert resumed[-1]["weight_digest_actor"] == fsdp2_reference[-1]["weight_digest_actor"]
    final = (tmp_path / "run" / "hf_model" / "model.safetensors").read_bytes()
    assert final == (fsdp2_reference_run / "hf_model" / "model.safetensors").read_bytes()


def test_a_run_stopped_before_its_export_was_complete_is_exported_by_the_same_command(
    fsdp2_reference_run, ray_cluster, tmp_path
):
    """Trained to the end and checkpointed, then stopped while writing ``hf_model/`` (here:
    the export removed, a cut-off one's staging folder left): the same command trains
    nothing and writes the export from the last checkpoint, byte for byte the one the
    uninterrupted run wrote; run once more, it finds the run finished."""
    from rlwire.trainer.outputs.export import exported_step

    run = tmp_path / "run"
    shutil.copytree(fsdp2_reference_run, run)
    assert exported_step(run) == 3
    shutil.rmtree(run / "hf_model")
    (run / "hf_model.tmp").mkdir()
    (run / "hf_model.tmp" / "model.safetensors").write_bytes(b"cut off")
    trained = (run / "metrics.jsonl").read_text()
    common = (*FSDP2_REFERENCE, "trainer.steps=3")
    _, out = train_cli(run, *common, cluster=ray_cluster)
    assert "exported hf_model/ of step 3 (training had finished)" in out, out[-2000:]
    assert (run / "metrics.jsonl").read_text() == trained  # no step trained again
    model = "hf_model/model.safetensors"
    assert (run / model).read_bytes() == (fsdp2_reference_run / model).read_bytes()
    assert exported_step(run) == 3 and not (run / "hf_model.tmp").exists()
    _, out = train_cli(run, *common, cluster=ray_cluster)
    assert "already holds a finished run (3 of trainer.steps=3)" in out


def test_the_export_marker_names_a_complete_export_only(tmp_path):
    from rlwire.trainer.outputs.export import EXPORT_MARKER, exported_step, mark_exported

    assert exported_step(tmp_path) is None  # no hf_model/
    (tmp_path / "hf_model").mkdir()
    assert exported_step(tmp_path) is None  # an export from before the marker, or cut off
    mark_exported(tmp_path, 7)
    assert exported_step(tmp_path) == 7
    assert sorted(p.name for p in (tmp_path / "hf_model").iterdir()) == [EXPORT_MARKER]
    for damaged in ("", "{", '{"step": "7"}', '{"steps": 7}', "[7]"):
        (tmp_path / "hf_model" / EXPORT_MARKER).write_text(damaged)
        assert exported_step(tmp_path) is None, damaged


def _saving_actor_pids(cluster: str) -> list[int]:
    """Processes of the Ray cluster at ``cluster`` running an actor rank's ``save`` now (Ray
    titles a worker process by the method it runs: ``ray::ActorWorker.save``; its parent,
    the raylet, names the cluster's GCS address)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if not (entry / "cmdline").read_bytes().startswith(b"ray::ActorWorker.save"):
                continue
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            if cluster.encode() in Path(f"/proc/{parent}/cmdline").read_bytes():
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def test_an_actor_killed_while_saving_leaves_the_last_checkpoint_to_resume_from(
    ray_cluster, tmp_path
):
    import os
    import signal
    import threading
    import time

    from rlwire.trainer.driver import run
    from rlwire.trainer.outputs.checkpoint_dirs import latest_checkpoint

    out = tmp_path / "run"
    overrides = ["actor.world_size=2", "trainer.save_every=1", "trainer.max_checkpoints_to_keep=2"]
    config = load_config(
        overrides=[
            f"trainer.output_dir={out}",
            *overrides,
            "trainer.steps=60",
            "ray.startup_timeout=300",
            f"ray.address={ray_cluster}",
        ]
    )
    killed: dict[str, object] = {}

    def killer() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "pid" not in killed:
            if (out / "checkpoints" / "step_2" / "COMPLETE").exists():
                for pid in _saving_actor_pids(ray_cluster)[:1]:
                    saving = sorted(p.name for p in (out / "checkpoints").iterdir())
                    os.kill(pid, signal.SIGKILL)
                    killed.update(pid=pid, dirs=saving)
            time.sleep(0.001)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pytest.raises(RunError, match=r"^saving: actor rank [01] died \(ActorDiedError: "):
        run(config, progress=False)
    thread.join(timeout=10)
    assert "pid" in killed, "no save was caught in progress"
    cut = [p for p in (out / "checkpoints").iterdir() if not (p / "COMPLETE").exists()]
    assert len(cut) == 1, killed  # the save that was cut off, never marked complete
    last = latest_checkpoint(out)
    # (a save is written as step_<n>.partial and renamed once complete)
    assert cut[0].name.endswith(".partial")
    cut_step = int(cut[0].name.removesuffix(".partial").split("_")[1])
    assert last is not None and int(last.name.split("_")[1]) < cut_step
    # The same command resumes from the last complete one; the cut-off save is replaced.
    done = int(last.name.split("_")[1])
    records, _ = train_cli(out, *overrides, f"trainer.steps={done + 2}", cluster=ray_cluster)
    assert [r["step"] for r in records] == list(range(1, done + 3))
    assert all((p / "COMPLETE").exists() for p in (out / "checkpoints").iterdir())


def test_resume_never_moves_an_earlier_runs_checkpoints_aside_so_pruning_keeps_the_new_ones(
    tmp_path,
):
    """Left in place, an earlier run's step_50 counts as the newest: pruning to one would remove
    the new run's step_2 as soon as it is saved, and resume=auto would go on from step_50."""
    from rlwire.trainer.outputs.checkpoint_dirs import (
        latest_checkpoint,
        prune_checkpoints,
        set_aside_checkpoints,
    )

    def saved(step: int) -> None:
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "COMPLETE").touch()

    saved(50)
    saved(2)  # what happened before: the new run's step_2 beside the earlier run's step_50
    assert prune_checkpoints(tmp_path, 1) == [tmp_path / "checkpoints" / "step_2"]
    (tmp_path / "checkpoints" / "step_50" / "COMPLETE").unlink()
    (tmp_path / "checkpoints" / "step_50").rmdir()
    (tmp_path / "checkpoints").rmdir()
    assert set_aside_checkpoints(tmp_path) is None  # nothing there: nothing moved
    saved(50)
    aside = set_aside_checkpoints(tmp_path)  # what trainer.resume=never does first
    assert aside == tmp_path / "checkpoints.before-1"
    assert (aside / "step_50" / "COMPLETE").exists()
    saved(2)
    assert prune_checkpoints(tmp_path, 1) == []
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_2"
    saved(3)
    assert set_aside_checkpoints(tmp_path) == tmp_path / "checkpoints.before-2"


def test_a_second_run_on_a_directory_a_live_run_holds_is_refused(tmp_path):
    import os
    import subprocess

    from rlwire.trainer.errors import RunError
    from rlwire.trainer.outputs.run_lock import RunLock

    held = RunLock(tmp_path)
    with pytest.raises(RunError) as err:
        RunLock(tmp_path)
    assert str(err.value) == (
        f"trainer.output_dir: {tmp_path} is in use by a live run (process {os.getpid()}); "
        "wait for it to end, or choose another trainer.output_dir"
    )
    held.release()
    RunLock(tmp_path).release()  # free again
    # a run killed while holding it holds nothing: the kernel drops the lock with the process
    script = (
        "import os, sys; from pathlib import Path\n"
        "from rlwire.trainer.outputs.run_lock import RunLock\n"
        f"RunLock(Path({str(tmp_path)!r})); os.kill(os.getpid(), 9)\n"
    )
    killed = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert killed.returncode == -9
    RunLock(tmp_path).release()
