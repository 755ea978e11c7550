"""A vllm_server server is sent the run's token only once the socket on its port is its own
(a stranger that bound the port first gets nothing), and /health never carries the token."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import pytest

from rlwire.trainer.rollout.listeners import foreign_listeners, held_sockets, listening_inodes
from rlwire.trainer.rollout.vllm_process import ServerProcess

LISTEN = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
    "print('up', flush=True); time.sleep(600)\n"
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listener(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "up\n"
    return process


def test_the_listening_socket_is_found_and_told_apart_from_a_strangers():
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        port = mine.getsockname()[1]
        inodes = listening_inodes(port)
        assert len(inodes) == 1 and inodes <= held_sockets({__import__("os").getpid()})
    stranger = _listener(port := _port())
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
    port = _port()
    stranger = _listener(port)
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
    own = _listener(port := _port())  # a server that holds its own port passes
    with tempfile.TemporaryFile() as own_log:
        try:
            ServerProcess(own, f"http://127.0.0.1:{port}", own_log, "t").check_listener()
        finally:
            own.kill()
            own.wait()


def test_health_is_asked_without_the_token():
    from rlwire.trainer.rollout.vllm_http import VLLMServer

    seen = {}
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = VLLMServer(f"http://127.0.0.1:{port}", timeout=5, token="secret-token")
        import threading

        def answer():
            conn, _ = server.accept()
            with conn:
                seen["request"] = conn.recv(65536).decode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

        thread = threading.Thread(target=answer)
        thread.start()
        assert client.healthy()
        thread.join(timeout=10)
    assert seen["request"].startswith("GET /health") and "secret-token" not in seen["request"]


@pytest.mark.parametrize(
    "answer",
    [b"GARBAGE\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nnot"],
    ids=["not-http", "cut-short"],
)
def test_a_malformed_health_answer_is_no_answer_never_an_escaping_error(answer):
    """The health watcher's thread died on http.client's exceptions: a server that hung
    later went unnoticed."""
    import threading

    from rlwire.trainer.rollout.vllm_http import VLLMServer

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def reply():
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

        thread = threading.Thread(target=reply)
        thread.start()
        assert VLLMServer(f"http://127.0.0.1:{port}", timeout=5).healthy() is False
        thread.join(timeout=10)


def test_an_answer_that_is_not_json_is_one_line():
    import threading

    from rlwire.trainer.rollout.vllm_http import VLLMServer

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def reply():
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n<html")

        thread = threading.Thread(target=reply)
        thread.start()
        with pytest.raises(RuntimeError, match=r"/v1/models answered something other than JSON"):
            VLLMServer(f"http://127.0.0.1:{port}", timeout=5)._call("/v1/models")
        thread.join(timeout=10)
