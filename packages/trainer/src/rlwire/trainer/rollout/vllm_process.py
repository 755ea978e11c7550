"""The ``vllm serve`` server process a ``vllm_server`` rollout worker starts when no URL is
given: its command line (no secret on it), its start and stop, its log (a file without a
name, ``O_TMPFILE``: nothing is left in ``/tmp`` however the worker ends), and the watchdog
it runs under. The HTTP calls to it: :mod:`.vllm_http`.

Run as ``python -m rlwire.trainer.rollout.vllm_process PARENT_PID COMMAND...``: a watchdog
that runs ``COMMAND`` (the server) and stops it when the process ``PARENT_PID`` is gone, so
that a rollout worker killed outright leaves no server behind; the server also gets SIGTERM
when the watchdog itself is killed (Linux). The parent is known by more than its pid, which
the kernel gives to a new process once it is free (:class:`Parent`). The watchdog gives the
server a private directory for vLLM's ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``,
:func:`~.vllm.rpc_dir`) and removes it once the server has exited; a watchdog killed
outright leaves it to the next one's sweep.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from rlwire.ckpt_engine import WEIGHT_TRANSFER_TOKEN_ENV

from .listeners import foreign_listeners
from .vllm import CPU_KV_CACHE_BYTES, INSTALL_HINT, RPC_PATH_ENV, rpc_dir
from .vllm_http import EXTENSION, GUARD, VLLMServer

__all__ = ["Parent", "ServerProcess", "process_start", "server_command"]

log = logging.getLogger("rlwire.trainer")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    config, model_path: str, *, backend: str, port: int, on_gpu: bool, gpu_share: float = 1.0
) -> list[str]:
    """The ``vllm serve`` command of a server a rollout worker starts: loopback, the rlwire
    engine of the run's checkpoint-engine ``backend`` only (``rlwire_<backend>``, not the
    name that takes any), rlwire's worker extension and token guard, the ``rollout.vllm``
    options. No secret: a command line is visible to every user of the host."""
    cfg = config.rollout.vllm
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", config.model.dtype, "--seed", str(config.trainer.seed),
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        "--weight-transfer-config", json.dumps({"backend": f"rlwire_{backend}"}),
        "--worker-extension-cls", EXTENSION, "--middleware", GUARD,
    ]  # fmt: skip
    if cfg.enforce_eager:
        command.append("--enforce-eager")
    kv_bytes = cfg.kv_cache_memory_bytes
    if kv_bytes is None and not on_gpu:
        kv_bytes = CPU_KV_CACHE_BYTES
    if kv_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if on_gpu:
        command += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization * gpu_share)]
    if cfg.max_model_len is not None:
        command += ["--max-model-len", str(cfg.max_model_len)]
    return command


class ServerProcess:
    """A ``vllm serve`` server this rollout worker started, on its own node (loopback), that
    takes weights only with its ``token``; its output goes to ``log``, a file without a name
    that this object holds open until :meth:`stop`."""

    def __init__(self, process: subprocess.Popen, url: str, log: IO[bytes], token: str) -> None:
        self.process, self.url, self.log, self.token = process, url, log, token
        atexit.register(self.stop)

    @classmethod
    def start(
        cls, config, model_path: str, *, backend: str, gpu_share: float = 1.0
    ) -> ServerProcess:
        """Start the server for ``model_path`` with the weight-transfer engine of the run's
        checkpoint-engine ``backend`` (resolved: ``shm``, ``gloo``, ..., not ``auto``) and a
        fresh token in its environment."""
        if backend == "auto":
            raise ValueError("ServerProcess.start: backend is the run's resolved one, not 'auto'")
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                INSTALL_HINT.replace("rollout.backend=vllm", "rollout.backend=vllm_server")
                + "; or give running servers: rollout.server_urls"
            )
        import torch

        port, on_gpu, token = _free_port(), torch.cuda.is_available(), secrets.token_hex(32)
        command = server_command(
            config, model_path, backend=backend, port=port, on_gpu=on_gpu, gpu_share=gpu_share
        )
        env = {
            **os.environ,
            WEIGHT_TRANSFER_TOKEN_ENV: token,  # the environment: other users do not see it
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
        }
        if not on_gpu:
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
        return cls.launch(command, env, url=f"http://127.0.0.1:{port}", token=token)

    @classmethod
    def launch(
        cls, command: list[str], env: dict[str, str], *, url: str, token: str
    ) -> ServerProcess:
        """Run ``command`` under this module's watchdog, its output into a file without a
        name (``O_TMPFILE`` where the kernel has it, unlinked at once elsewhere): it goes
        with the last process that holds it open, however this worker ends."""
        log = tempfile.TemporaryFile(  # noqa: SIM115  (open for the server's life: stop())
            prefix="rlwire-vllm-server-", suffix=".log"
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid()), *command],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            log.close()
            raise
        return cls(process, url, log, token)

    def tail(self, lines: int = 20, *, limit: int = 1 << 16) -> str:
        """The last ``lines`` lines of the server's output (of its last ``limit`` bytes)."""
        try:
            fd = self.log.fileno()
            size = os.fstat(fd).st_size
            raw = os.pread(fd, limit, max(0, size - limit))
        except (OSError, ValueError):  # closed: stopped
            return ""
        return "\n".join(raw.decode(errors="replace").splitlines()[-lines:])

    def wait_ready(self, server: VLLMServer, timeout: float) -> None:
        """Wait until the server answers ``/health`` (which is asked without the token) and
        the socket listening on its port is its own; only then is the token sent.

        Raises:
            RuntimeError: the server exited or did not answer in time, or another process
                listens on its port (it bound the port first: nothing is sent to it).
        """
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()  # first: a stranger's /health must not pass for it
            if code is not None:
                raise RuntimeError(
                    f"vllm_server: the server for {self.url} exited with code {code}:\n"
                    + self.tail()
                )
            if server.healthy():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm_server: the server for {self.url} did not answer /health within "
                    f"{timeout:g} s (ray.startup_timeout):\n{self.tail()}"
                )
            time.sleep(0.5)
        self.check_listener()

    def check_listener(self) -> None:
        """Refuse a port where a socket not held by the server's own processes listens."""
        port = int(self.url.rsplit(":", 1)[1])
        foreign = foreign_listeners(port, self.process.pid)
        if foreign:
            self.stop()
            raise RuntimeError(
                f"vllm_server: another process listens on port {port}, where the server this "
                "worker started should (it bound the port first); nothing was sent to it"
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # the watchdog stops the server, then exits
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.log.close()


def _die_with_parent() -> None:
    """In the server's process before it runs (Linux): SIGTERM when the watchdog is gone,
    even killed outright (Ray kills a worker's child processes when the worker exits)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def process_start(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When process ``pid`` started (clock ticks after boot: field 22 of
    ``/proc/<pid>/stat``), which a process that takes its pid later does not share; None
    where there is no such process, it has exited (a zombie) or there is no ``/proc``."""
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # field 2, the command name, may hold spaces and parentheses: the rest follows the last ")"
    fields = raw[raw.rfind(b")") + 1 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X") or not fields[19].isdigit():
        return None
    return int(fields[19])


class Parent:
    """The process ``pid`` as it is now, not whichever takes its pid once it exits.

    Three checks, the strongest first: a watchdog whose parent it is sees it gone when it is
    given another (``os.getppid()``: a reparented process never gets the old pid back); on
    Linux the start time recorded now (:func:`process_start`) must stay the same; elsewhere
    only ``os.kill(pid, 0)``, which a reused pid fools.
    """

    def __init__(self, pid: int, proc: Path = Path("/proc")) -> None:
        self.pid, self.proc = pid, proc
        self.child = os.getppid() == pid
        self.started = process_start(pid, proc)
        self.gone = self.started is None and (proc / str(os.getpid()) / "stat").exists()
        """It had exited before this was made (``/proc`` works and does not show it)."""

    def alive(self) -> bool:
        if self.gone or (self.child and os.getppid() != self.pid):
            return False
        if self.started is not None:
            return process_start(self.pid, self.proc) == self.started
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's: it exists
            return True
        return True


def _watch(parent: int, command: list[str]) -> int:
    """Run ``command`` until it exits, or until ``parent`` is gone or this process is asked
    to stop: then stop it (SIGTERM, SIGKILL after 30 s). Its vLLM sockets go in a directory
    of this process's (``VLLM_RPC_BASE_PATH``), removed once it has exited."""
    watched = Parent(parent)  # first: before the server's start gives it time to exit
    rpc = rpc_dir()
    try:
        env = {**os.environ, RPC_PATH_ENV: str(rpc.path)}
        return _serve(watched, subprocess.Popen(command, preexec_fn=_die_with_parent, env=env))
    finally:
        rpc.close()


def _serve(parent: Parent, child: subprocess.Popen) -> int:
    """Wait for ``child`` (see :func:`_watch`); its exit status."""
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while child.poll() is None:
        if not parent.alive():
            stopping = True
        if stopping:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
            break
        time.sleep(0.5)
    return child.wait()


if __name__ == "__main__":
    sys.exit(_watch(int(sys.argv[1]), sys.argv[2:]))
