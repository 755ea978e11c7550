"""What a job leaves behind: scratch directories removed on every exit path (a kill included:
swept by the next one), and workers asked to close before they are killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from trainer_pipes import first_line  # this folder: pytest puts it on sys.path

from rlwire.trainer.rollout.scratch import ScratchDir, sweep

PREFIX = "rlwire-test-scratch-"


def _process_making_one(parent, *, then: str) -> tuple[subprocess.Popen, str]:
    """A process that makes a :class:`ScratchDir` in ``parent`` with a file in it, prints
    its path, then runs ``then``."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from rlwire.trainer.rollout.scratch import ScratchDir
        scratch = ScratchDir({PREFIX!r}, parent={str(parent)!r})
        (scratch.path / "v1").mkdir()
        (scratch.path / "v1" / "adapter.safetensors").write_bytes(b"weights")
        print(scratch.path, flush=True)
        {then}
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    path = first_line(proc, "the scratch directory a process made", timeout=60).strip()
    assert path, "the process making a scratch directory printed an empty line"
    return proc, path


def test_a_scratch_directory_carries_its_pid_and_close_removes_it(tmp_path):
    scratch = ScratchDir(PREFIX, parent=tmp_path)
    assert scratch.path.parent == tmp_path
    assert scratch.path.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert (scratch.path.stat().st_mode & 0o777) == 0o700
    (scratch.path / "v3").mkdir()
    (scratch.path / "v3" / "adapter_config.json").write_text("{}")
    assert not scratch.closed
    scratch.close()
    assert scratch.closed and not scratch.path.exists()
    scratch.close()  # a second close does nothing


def test_the_interpreters_exit_removes_a_scratch_directory(tmp_path):
    proc, path = _process_making_one(tmp_path, then="sys.exit(0)")
    assert proc.wait(timeout=60) == 0
    assert not os.path.exists(path)


def test_a_killed_processs_directory_is_swept_by_the_next_and_no_other(tmp_path):
    killed, killed_path = _process_making_one(tmp_path, then="time.sleep(600)")
    alive, alive_path = _process_making_one(tmp_path, then="time.sleep(600)")
    try:
        killed.send_signal(signal.SIGKILL)  # no finalizer runs
        killed.wait(timeout=60)  # reaped: its pid is gone
        assert os.path.isdir(killed_path)
        # what the sweep must keep: a name without a pid (made before names carried one),
        # another user's, a symlink named like one (and its target), a non-directory
        legacy = tmp_path / f"{PREFIX}04zr4ud3"
        legacy.mkdir()
        target = tmp_path / "target"
        target.mkdir()
        link = tmp_path / f"{PREFIX}{killed.pid}-link"
        link.symlink_to(target)
        plain = tmp_path / f"{PREFIX}{killed.pid}-file"
        plain.write_text("not a directory")
        foreign = tmp_path / f"{PREFIX}{killed.pid}-foreign"
        foreign.mkdir()
        if os.geteuid() == 0:
            os.chown(foreign, 65534, -1)
        else:  # an unprivileged user cannot give it away: kept for want of rights anyway
            foreign.rmdir()
        fresh = ScratchDir(PREFIX, parent=tmp_path)
        assert [str(p) for p in fresh.swept] == [killed_path]
        assert not os.path.exists(killed_path)
        assert os.path.isdir(alive_path) and os.path.isfile(f"{alive_path}/v1/adapter.safetensors")
        assert legacy.is_dir() and link.is_symlink() and target.is_dir() and plain.is_file()
        assert foreign.is_dir() or os.geteuid() != 0
        assert fresh.path.is_dir()  # its own is made after the sweep
        assert sweep(PREFIX, parent=tmp_path) == []  # this process's own is kept
        fresh.close()
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(timeout=60)
    # the second process is gone now too: the next sweep takes its directory
    assert [str(p) for p in sweep(PREFIX, parent=tmp_path)] == [alive_path]


def test_the_vllm_engines_close_removes_its_adapter_versions_and_sockets(tmp_path, monkeypatch):
    """``VLLMEngine.close`` (vLLM itself is not needed: it is imported by ``__init__``
    only): the engine's core stopped, then its adapters' directory and its sockets'
    directory (``VLLM_RPC_BASE_PATH``) removed, and the variable as it was before."""
    import socket

    from rlwire.trainer.rollout.vllm import ADAPTERS_PREFIX, RPC_PATH_ENV, RPC_PREFIX, VLLMEngine

    engine = object.__new__(VLLMEngine)  # the state close() reads; no vLLM engine
    engine.core = None
    engine._adapters = ScratchDir(ADAPTERS_PREFIX, parent=tmp_path)
    (engine._adapters.path / "v0").mkdir()
    engine._rpc = ScratchDir(RPC_PREFIX, parent=tmp_path)
    engine._rpc_before = "/elsewhere"
    monkeypatch.setenv(RPC_PATH_ENV, str(engine._rpc.path))  # as __init__ leaves it
    with socket.socket(socket.AF_UNIX) as zmq_like:  # a socket file, as vLLM's engine makes
        zmq_like.bind(str(engine._rpc.path / "0b5e7c1a"))
    engine.close()
    assert not engine._adapters.path.exists() and not engine._rpc.path.exists()
    assert os.environ[RPC_PATH_ENV] == "/elsewhere"


def _ends_within(ray, worker, seconds: float) -> bool:
    """Whether ``worker``'s calls fail as a dead actor's within ``seconds``: ``ray.kill``
    is asynchronous, so a call made just after it may still be answered by the process."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(worker.pid.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.2)
    return False


def test_close_workers_closes_each_then_kills_all_without_waiting_on_a_stuck_one(
    ray_cluster, tmp_path
):
    """A worker's close runs (its finalizer: a file here) before the kill; one whose close
    never ends, and one already dead, are reported and killed without holding the rest."""
    from rlwire.trainer.runtime.cluster import ray_environment
    from rlwire.trainer.runtime.waits import close_workers

    ray_environment()
    import ray

    ray.init(address=ray_cluster, log_to_driver=False, namespace="test-close-workers")
    try:

        @ray.remote(num_cpus=0)
        class Worker:
            def __init__(self, marker: str) -> None:
                self.marker = marker

            def close(self) -> None:
                if self.marker == "stuck":
                    import threading

                    threading.Event().wait()  # never returns
                with open(self.marker, "w") as f:
                    f.write("closed")

            def pid(self) -> int:
                return os.getpid()

        marker = tmp_path / "closed.txt"
        closing, stuck, dead = Worker.remote(str(marker)), Worker.remote("stuck"), Worker.remote("")
        workers = [closing, stuck, dead]
        ray.get([w.pid.remote() for w in workers], timeout=120)  # all three started
        ray.kill(dead, no_restart=True)
        closes = [(f"worker {i}", w.close.remote()) for i, w in enumerate(workers)]
        problems = close_workers(workers, closes, timeout=3.0)
        assert marker.read_text() == "closed"
        assert problems[0] == "worker 1: its close did not end within 3 s; killed"
        assert problems[1].startswith("worker 2: close failed: ")
        assert len(problems) == 2
        for w in workers:  # every one killed, the one that closed included
            assert _ends_within(ray, w, 60.0), "a worker still answers 60 s after its kill"
    finally:
        ray.shutdown()


def test_loops_that_end_after_the_last_step_cost_a_line_when_a_worker_died(ray_cluster):
    """Watch.ends, the fully-async run's last wait (its rollout loops' ends): a worker that
    died by then is a line for the log, not the run's end (issue 64, item 4b: a worker
    killed as the loops were stopped used to end a complete run with exit 2); any other
    failure still raises, naming it."""
    from rlwire.trainer.errors import RunError
    from rlwire.trainer.runtime.cluster import ray_environment
    from rlwire.trainer.runtime.waits import Watch

    ray_environment()
    import ray

    ray.init(address=ray_cluster, log_to_driver=False, namespace="test-loop-ends")
    try:

        @ray.remote(num_cpus=0)
        class Loop:
            def run(self, how: str) -> str:
                if how == "dies":
                    os._exit(1)
                if how == "fails":
                    raise ValueError("the loop's own error")
                return how

        workers = [Loop.remote() for _ in range(3)]
        names = {w._actor_id.hex(): f"rollout worker {i}" for i, w in enumerate(workers)}
        watch = Watch([], names, {a: i for i, a in enumerate(names)})
        ends = [workers[0].run.remote("stop"), workers[1].run.remote("dies")]
        lines = watch.ends(ends, timeout=120, what="stopping the rollout loops")
        assert len(lines) == 1
        assert lines[0].startswith("stopping the rollout loops: rollout worker 1 died (")
        assert lines[0].endswith("after the run's last step: nothing was lost")
        with pytest.raises(RunError, match="stopping the rollout loops: ValueError: the loop's"):
            watch.ends(
                [workers[2].run.remote("fails")], timeout=120, what="stopping the rollout loops"
            )
    finally:
        ray.shutdown()
