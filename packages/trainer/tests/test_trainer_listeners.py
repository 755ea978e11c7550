"""A vllm_server server is sent the run's token only once the socket on its port is its own
(a stranger that bound the port first gets nothing), and /health never carries the token."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from trainer_pipes import first_line  # this folder: pytest puts it on sys.path

from rlwire.trainer.rollout.listeners import foreign_listeners, held_sockets, listening_inodes
from rlwire.trainer.rollout.vllm_process import ServerProcess

LISTEN = (
    "import socket, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "print(s.getsockname()[1], flush=True); time.sleep(600)\n"
)


def _listener() -> tuple[subprocess.Popen, int]:
    """A process listening on a port the kernel picked for it, held until the process ends
    (no port picked here, closed, then bound by the child: another process could take it in
    between): the process and its port."""
    process = subprocess.Popen(
        [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return process, int(first_line(process, "the port a listening process bound", timeout=60))


def test_the_listening_socket_is_found_and_told_apart_from_a_strangers():
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        port = mine.getsockname()[1]
        inodes = listening_inodes(port)
        assert len(inodes) == 1 and inodes <= held_sockets({__import__("os").getpid()})
    stranger, port = _listener()
    try:
        assert foreign_listeners(port, stranger.pid) == set()  # its own tree: nothing foreign
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        try:
            assert foreign_listeners(port, ours.pid) == listening_inodes(port) != set()
        finally:
            ours.kill()
            ours.wait()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_server_whose_port_a_stranger_holds_is_stopped_and_sent_nothing():
    stranger, port = _listener()
    log = tempfile.TemporaryFile()  # noqa: SIM115  (the server object closes it: stop())
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    server = ServerProcess(ours, f"http://127.0.0.1:{port}", log, token="t" * 64)
    try:
        with pytest.raises(RuntimeError) as err:
            server.check_listener()
        assert str(err.value) == (
            f"vllm_server: another process listens on port {port}, where the server this "
            "worker started should (it bound the port first); nothing was sent to it"
        )
        deadline = time.monotonic() + 10
        while ours.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ours.poll() is not None  # stopped
    finally:
        stranger.kill()
        stranger.wait()
        if ours.poll() is None:
            ours.kill()
    own, port = _listener()  # a server that holds its own port passes
    with tempfile.TemporaryFile() as own_log:
        try:
            ServerProcess(own, f"http://127.0.0.1:{port}", own_log, "t").check_listener()
        finally:
            own.kill()
            own.wait()


@contextlib.contextmanager
def _answering(answer: bytes) -> Iterator[tuple[str, dict]]:
    """A loopback server that answers one request with ``answer``: its URL, and what it
    was sent (``request``) once the block ends."""
    seen: dict = {}
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def reply() -> None:
            conn, _ = server.accept()
            with conn:
                seen["request"] = conn.recv(65536).decode(errors="replace")
                conn.sendall(answer)

        thread = threading.Thread(target=reply)
        thread.start()
        yield f"http://127.0.0.1:{server.getsockname()[1]}", seen
        thread.join(timeout=10)


def test_health_is_asked_without_the_token():
    from rlwire.trainer.rollout.vllm_http import VLLMServer

    with _answering(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n") as (url, seen):
        assert VLLMServer(url, timeout=5, token="secret-token").healthy()
    assert seen["request"].startswith("GET /health") and "secret-token" not in seen["request"]


@pytest.mark.parametrize(
    "answer",
    [b"GARBAGE\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nnot"],
    ids=["not-http", "cut-short"],
)
def test_a_malformed_health_answer_is_no_answer_never_an_escaping_error(answer):
    """The health watcher's thread died on http.client's exceptions: a server that hung
    later went unnoticed."""
    from rlwire.trainer.rollout.vllm_http import VLLMServer

    with _answering(answer) as (url, _):
        assert VLLMServer(url, timeout=5).healthy() is False


def test_an_answer_that_is_not_json_is_one_line():
    from rlwire.trainer.rollout.vllm_http import VLLMServer

    html = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n<html"
    refused = pytest.raises(RuntimeError, match=r"/v1/models answered something other than JSON")
    with _answering(html) as (url, _), refused:
        VLLMServer(url, timeout=5)._call("/v1/models")
