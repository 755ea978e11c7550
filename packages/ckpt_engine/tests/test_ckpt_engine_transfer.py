"""One sender and two receivers in separate processes, per backend."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from ckpt_engine_worker import (  # this folder: pytest puts it on sys.path
    DELTA_VERSIONS,
    FAILURE_TIMEOUT,
    make_delta_state,
    make_state,
    member,
)

from rlwire.ckpt_engine._wire import as_bytes

# Members are forked from one server that imported torch and the worker module once (what it
# preloads is set in conftest.py, once for the process).
_PROCESSES = multiprocessing.get_context("forkserver")

BACKENDS = ["gloo", "shm", "filesystem"]
WORLD = 3  # one sender, two receivers


def _run_group(backend: str, scenario: str, tmp_path: Path, world: int = WORLD) -> list[dict]:
    procs, outs, logs = [], [], []
    for rank in range(world):
        outs.append(tmp_path / f"rank{rank}.pt")
        logs.append(tmp_path / f"rank{rank}.log")
        args = (backend, scenario, rank, world, str(tmp_path), str(outs[-1]))
        procs.append(_PROCESSES.Process(target=member, args=(args, str(logs[-1]))))
        procs[-1].start()
    deadline = time.monotonic() + 180
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    reports = []
    for rank, out in enumerate(outs):
        if out.exists():
            reports.append(torch.load(out, weights_only=False))
        else:
            log = logs[rank].read_text() if logs[rank].exists() else ""
            reports.append({"exit": procs[rank].exitcode, "log": log[-4000:]})
    return reports


def _changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of ``a`` and ``b`` whose bytes differ."""
    width = a.element_size()
    rows_a = as_bytes(a).view(-1, width) if a.numel() else as_bytes(a).view(0, width)
    rows_b = as_bytes(b).view(-1, width) if b.numel() else as_bytes(b).view(0, width)
    return int((rows_a != rows_b).any(dim=1).sum())


def _assert_bit_identical(got: list, expected: list) -> None:
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(as_bytes(a), as_bytes(b)), name


@pytest.mark.parametrize(
    ("backend", "scenario"),
    # broadcast-cpu: the engine class behind nccl and hccl, on the CPU over gloo.
    [(b, "roundtrip") for b in BACKENDS] + [("shm", "shared"), ("broadcast-cpu", "roundtrip")],
)
def test_three_updates_arrive_bit_identical(backend, scenario, tmp_path):
    sender, *receivers = _run_group(backend, scenario, tmp_path)
    assert sender.get("error") is None, sender
    expected = [make_state(v) for v in (1, 2, 3)]
    nbytes = sum(t.numel() * t.element_size() for _, t in expected[0])
    assert sender["stats"][0][:2] == [nbytes, len(expected[0])]
    assert sender["lower_version_error"] == "version 0 is lower than the last one sent (3)"
    if scenario == "shared":
        assert sender["shared_bytes"] >= nbytes
        assert sender["stats"][0][2] == 1  # every tensor read in place: one (empty) bucket
        # Slots and arena were unlinked once every receiver had mapped them.
        assert not list(Path("/dev/shm").glob(sender["token"] + "*"))
    for report in receivers:
        assert report.get("error") is None, report
        assert [v for v, _ in report["updates"]] == [1, 2, 3]
        for (_, got), want in zip(report["updates"], expected, strict=True):
            _assert_bit_identical(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("backend", "gpus", "world"), [("cuda_ipc", 1, 3), ("nccl", 2, 2)])
def test_gpu_backends_arrive_bit_identical(backend, gpus, world, tmp_path):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{backend} needs {gpus} GPUs")
    sender, *receivers = _run_group(backend, "roundtrip", tmp_path, world=world)
    assert sender.get("error") is None, sender
    for report in receivers:
        assert report.get("error") is None, report
        assert [v for v, _ in report["updates"]] == [1, 2, 3]
        for (_, got), version in zip(report["updates"], (1, 2, 3), strict=True):
            _assert_bit_identical(got, make_state(version))


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_killed_mid_update_fails_the_sender_within_timeout(backend, tmp_path):
    sender, first, killed = _run_group(backend, "kill", tmp_path)
    assert killed["exit"] == 3
    assert sender["error"] is not None, sender
    assert sender["error"][0] == "CheckpointEngineTimeout", sender
    assert sender["seconds"] < FAILURE_TIMEOUT + 10, sender


@pytest.mark.parametrize("backend", ["shm", "filesystem"])
def test_abort_ends_every_members_wait_for_a_dead_receiver(backend, tmp_path):
    """The sender, told that a receiver died, ends its own wait for that receiver and the
    other receivers' waits at once: each ends with the abort naming the cause, not with
    the timeout (15 s here) it would otherwise wait out. (gloo's waits end by themselves:
    a dead peer's connections close, the test above. The broadcast engines' receivers wait
    inside a collective, which only the communicator's abort ends: NCCL's and HCCL's, not
    run here; torch's CPU gloo group of the floor stack has none, and there a receiver
    already in a broadcast waits the timeout.)"""
    sender, survivor, killed = _run_group(backend, "abort", tmp_path)
    assert killed["exit"] == 3
    kind, message = sender["error"]
    assert kind == "CheckpointEngineAborted", sender
    assert "the update was aborted" in message and "died" in message, message
    if backend == "filesystem":  # it read its own copy, written whole before the wait
        assert survivor["error"] is None, survivor
        _assert_bit_identical(survivor["updates"][0][1], make_state(1))
    else:
        assert survivor["error"][0] == "CheckpointEngineAborted", survivor
        assert "died" in survivor["error"][1], survivor


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_bucket_is_detected_with_checksum(backend, tmp_path):
    sender, corrupted, clean = _run_group(backend, "corrupt", tmp_path)
    kind, message = corrupted["error"]
    assert kind == "CheckpointEngineError", corrupted
    if backend == "filesystem":
        # Names the tensor whose bytes changed on disk.
        assert message.startswith("filesystem: version 1, tensor '")
        assert "' is corrupted: checksum 0x" in message
        # The other receiver reads its own intact copy from disk.
        assert clean["error"] is None
        _assert_bit_identical(clean["updates"][0][1], make_state(1))
    else:
        # Names the bucket and the tensors in it.
        assert message.startswith("bucket 0 of version 1 is corrupted: checksum 0x"), message
        assert "'fp32'" in message and "'bf16_odd'" in message
        # One failed receiver fails the group's update for everyone, in bounded time.
        assert clean["error"][0] == "CheckpointEngineTimeout", clean
    # The corrupted receiver never acknowledged: the sender times out rather than hangs.
    assert sender["error"][0] == "CheckpointEngineTimeout"
    assert sender["seconds"] < FAILURE_TIMEOUT + 10


@pytest.mark.parametrize(
    ("backend", "scenario"),
    [("gloo", "delta"), ("shm", "delta"), ("broadcast-cpu", "delta"), ("gloo", "delta-zstd")],
)
def test_delta_updates_arrive_bit_identical_over_five_versions(backend, scenario, tmp_path):
    sender, *receivers = _run_group(backend, scenario, tmp_path)
    _check_delta_group(sender, *receivers)
    if scenario == "delta-zstd":  # compressed where smaller: fewer bytes than plain deltas
        from rlwire.ckpt_engine._delta import encode

        for version, s in zip(DELTA_VERSIONS[1:], sender["stats"][1:], strict=True):
            before, after = make_delta_state(version - 1), make_delta_state(version)
            plain = 0
            for (_, b), (_, a) in zip(before, after, strict=True):
                fmt, _, payload = encode(a.contiguous(), b.contiguous().clone())
                plain += payload.numel() if fmt else a.numel() * a.element_size()
            assert s.wire_bytes < plain, (version, s.wire_bytes, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("backend", "gpus"), [("cuda_ipc", 1), ("nccl", WORLD)])
def test_gpu_delta_updates_arrive_bit_identical_over_five_versions(backend, gpus, tmp_path):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{backend} needs {gpus} GPUs")
    _check_delta_group(*_run_group(backend, "delta", tmp_path))


def _check_delta_group(sender: dict, *receivers: dict) -> None:
    """Five versions with sparse changes: a dense first update, then deltas of exactly the
    changed elements, every version bit-identical at every receiver."""
    assert sender.get("error") is None, sender
    stats = sender["stats"]
    first = make_delta_state(1)
    nbytes = sum(t.numel() * t.element_size() for _, t in first)
    # The first update is dense (nobody holds anything); every later one is a delta from
    # the version before, and sends less than the dense bytes.
    assert [s.base for s in stats] == [None, 1, 2, 3, 4]
    assert stats[0].wire_bytes == stats[0].bytes == nbytes
    for version, s in zip(DELTA_VERSIONS[1:], stats[1:], strict=True):
        assert s.bytes == nbytes and 0 < s.wire_bytes < nbytes // 2, s
        # Exactly the elements whose bits differ from the version before.
        before, after = make_delta_state(version - 1), make_delta_state(version)
        assert s.changed == sum(
            _changed(a, b) for (_, a), (_, b) in zip(before, after, strict=True)
        ), s
        assert s.elements == sum(t.numel() for _, t in after)
    assert sender["mirror_bytes"] == nbytes  # the sender's extra memory: one copy
    for report in receivers:
        assert report.get("error") is None, report
        assert [v for v, _ in report["updates"]] == list(DELTA_VERSIONS)
        # Deltas arrived for every tensor that changed sparsely (not fp16, sent dense).
        assert report["deltas"][0] == 0 and min(report["deltas"][1:]) > 0
        for (_, got), version in zip(report["updates"], DELTA_VERSIONS, strict=True):
            _assert_bit_identical(sorted(got), sorted(make_delta_state(version)))


def test_a_receiver_that_missed_a_version_gets_dense_weights(tmp_path):
    sender, first, missed = _run_group("gloo", "delta-missed", tmp_path)
    assert sender.get("error") is None, sender
    # Receiver 2 held version 2 when update 4 came: dense for everyone, then deltas again.
    assert [s.base for s in sender["stats"]] == [None, 1, 2, None, 4]
    assert sender["stats"][3].wire_bytes == sender["stats"][3].bytes
    assert [v for v, _ in first["updates"]] == [1, 2, 3, 4, 5]
    assert [v for v, _ in missed["updates"]] == [1, 2, 4, 5]
    for report in (first, missed):
        for version, got in report["updates"]:
            _assert_bit_identical(sorted(got), sorted(make_delta_state(version)))


def test_corrupted_delta_bucket_is_detected_with_checksum(tmp_path):
    sender, corrupted, clean = _run_group("shm", "delta-corrupt", tmp_path)
    kind, message = corrupted["error"]
    assert kind == "CheckpointEngineError", corrupted
    assert " of version 2 is corrupted: checksum 0x" in message, message
    # Version 1 (dense) was applied; the corrupted delta was not.
    assert [v for v, _ in corrupted["updates"]] == [1]
    assert sender["error"][0] == "CheckpointEngineTimeout"
