"""Test helper (not a test module): a ``vllm serve`` server for a tiny model, started as a
user starts one (the docs' flags, ``--weight-transfer-config '{"backend": "rlwire"}'``, no
token), for the tests that give the run its URL (``rollout.server_urls``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def vllm_serve(where: Path, *, start_timeout: float = 240) -> Iterator[tuple[Path, str, int]]:
    """A server for a tiny model built in ``where``: ``(model_dir, url, pid)``, stopped (and
    its socket directory removed) on exit."""
    from rlwire.trainer.models.tiny import build_tiny_model

    model_dir = build_tiny_model(where / "tiny", seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rpc = tempfile.mkdtemp(prefix="rlwire-test-vllm-rpc-")  # its sockets, not in /tmp itself
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TORCHDYNAMO_DISABLE": "1",
           "VLLM_RPC_BASE_PATH": rpc}  # fmt: skip
    log_path = where / "serve.log"
    log = log_path.open("w")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--kv-cache-memory-bytes", str(64 << 20), "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm", "--weight-transfer-config", '{"backend": "rlwire"}',
            "--worker-extension-cls", "rlwire.ckpt_engine.vllm.WorkerExtension",
        ],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, f"vllm serve did not start in {start_timeout} s"
                time.sleep(1)
        yield model_dir, url, server.pid
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        shutil.rmtree(rpc, ignore_errors=True)


def weight_version(url: str) -> str | None:
    """The weight version the server at ``url`` reports (``/weight_info``)."""
    with urllib.request.urlopen(f"{url}/weight_info", timeout=30) as answer:
        return json.loads(answer.read())["weight_version"]
