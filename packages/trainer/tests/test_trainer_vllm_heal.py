"""A ``rollout.server_urls`` server that stops answering (``vllm_server``, marked ``vllm``: run
by ``.ci/vllm``): its worker is replaced, the replacement waits for the server with backoff,
and the server rejoins the weight group at the current weights (:mod:`rlwire.trainer.runtime.
healing`)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from trainer_cli import run_cli, train_cli

pytestmark = pytest.mark.vllm


def _stall(url: str, pid: int, *, at_version: int, seconds: float) -> threading.Thread:
    """A thread that stops the server (SIGSTOP: its port still accepts connections, nothing
    answers) once it holds weights ``at_version``, for ``seconds``, then lets it go on."""
    from vllm_serve import weight_version

    def stall() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            held = weight_version(url)
            if held is not None and held.isdigit() and int(held) >= at_version:
                break
            time.sleep(0.2)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=stall, name="stall", daemon=True)
    thread.start()
    return thread


def test_a_server_that_stops_answering_rejoins_at_the_current_weights(ray_cluster, tmp_path):
    """Fully async on one server given by URL, stopped for 20 s once it holds version 2
    (``rollout.vllm.health_timeout=6``): the requests in flight on it fail, its worker is
    replaced, the replacement waits for the server with backoff, takes it back holding
    this run's weights (an update it left open is ended), and the re-formed group sends it
    the current version whole. The run ends by itself (exit 0), every prompt group trained
    once, the groups it was generating generated again and counted; the server holds the
    last version sent. A second run on it, which now holds those weights, is refused."""
    pytest.importorskip("vllm", reason="needs vLLM (see .ci/vllm)")
    from vllm_serve import vllm_serve, weight_version

    with vllm_serve(tmp_path / "server") as (model_dir, url, pid):
        common = [f"model.path={model_dir}", "rollout.backend=vllm_server"]
        stalled = _stall(url, pid, at_version=2, seconds=20)
        records, out = train_cli(
            tmp_path / "run",
            *common,
            f"rollout.server_urls=[{url}]",
            "trainer.mode=fully_async",
            "trainer.steps=8",
            "rollout.vllm.health_timeout=6",
            cluster=ray_cluster,
        )
        stalled.join(timeout=60)
        assert not stalled.is_alive()
        assert "rollout worker 0 lost its engine; starting its replacement (restart 1 of 3" in out
        assert f"EngineLost: vllm_server {url}: no answer to" in out
        assert [r["step"] for r in records] == list(range(1, 9))
        assert records[-1]["rollout_restarts"] == 1
        assert all(r["rollout_engines_live"] == 1 for r in records)
        assert sum(r.get("regenerated_groups", 0) for r in records) > 0
        trained = [i for r in records for i in r["group_indices"]]
        assert len(trained) == len(set(trained)) == 8 * 8  # every group once
        assert all(r["version_lag_max"] <= 1 for r in records)
        assert weight_version(url) == str(records[-1]["weight_version"])  # it rejoined
        code, again = run_cli(tmp_path / "again", *common, f"rollout.server_urls=[{url}]",
                              cluster=ray_cluster)  # fmt: skip
        assert code != 0
        held = records[-1]["weight_version"]
        assert f"vllm_server {url} serves weights version {held} that an earlier run sent" in again
