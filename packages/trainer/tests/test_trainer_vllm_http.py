"""``rollout.backend=vllm_server``'s side of the HTTP conversation, against a stand-in server
(the real one: ``test_trainer_vllm.py``, marked ``vllm``): what it refuses at start, how it
reads completions, and the config it accepts."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from vllm_stand_in import StandIn

from rlwire.trainer.checks import ConfigError
from rlwire.trainer.config.root import load_config
from rlwire.trainer.rollout.vllm_http import GUARD, SERVER_FLAGS, VLLMServer
from rlwire.trainer.rollout.vllm_process import ServerProcess, server_command


class HeldRoutes(dict):
    """:class:`StandIn` routes of which ``held`` answers only once ``released`` is set (an
    update that lasts until the test lets it end), at most 60 s; ``asked`` is set once
    ``held`` was asked."""

    def __init__(self, routes: dict, held: str) -> None:
        super().__init__(routes)
        self.held, self.asked, self.released = held, threading.Event(), threading.Event()

    def get(self, path, default=None):
        if path == self.held:
            self.asked.set()
            self.released.wait(60)
        return super().get(path, default)


@pytest.fixture
def fake():
    servers = []

    def make(routes):
        servers.append(StandIn(routes))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _models(root: str) -> tuple[int, dict]:
    return 200, {"data": [{"id": root, "root": root}]}


def _versions(held, rlwire: bool = True) -> tuple[int, dict]:
    return 200, {"results": [{"backend": None, "held": held, "staged": None, "rlwire": rlwire}]}


def test_a_server_of_the_model_with_the_rlwire_engine_and_no_update_is_taken(fake, tmp_path):
    server = fake({"/v1/models": _models(str(tmp_path)), "/collective_rpc": _versions(None)})
    client = VLLMServer(server.url, timeout=5)
    client.check_serves(str(tmp_path))
    assert client.model_name == str(tmp_path)
    assert server.posts == [("/collective_rpc", {"method": "rlwire_weight_versions"})]


def test_a_server_of_another_model_is_refused_naming_both(fake, tmp_path):
    server = fake({"/v1/models": _models("/models/other"), "/collective_rpc": _versions(None)})
    with pytest.raises(RuntimeError) as err:
        VLLMServer(server.url, timeout=5).check_serves(str(tmp_path))
    assert str(err.value) == (
        f"vllm_server {server.url} serves ['/models/other'], not the model this run trains "
        f"({tmp_path})"
    )


def test_a_server_holding_an_earlier_runs_weights_is_refused(fake, tmp_path):
    server = fake({"/v1/models": _models(str(tmp_path)), "/collective_rpc": _versions(7)})
    with pytest.raises(RuntimeError, match="serves weights version 7 that an earlier run sent"):
        VLLMServer(server.url, timeout=5).check_serves(str(tmp_path))


def test_a_server_without_the_flags_is_refused_with_them(fake, tmp_path):
    # no /collective_rpc route: VLLM_SERVER_DEV_MODE unset
    server = fake({"/v1/models": _models(str(tmp_path))})
    with pytest.raises(RuntimeError) as err:
        VLLMServer(server.url, timeout=5).check_serves(str(tmp_path))
    assert "/collective_rpc answered 404" in str(err.value) and SERVER_FLAGS in str(err.value)
    # another weight-transfer engine than rlwire's
    server = fake({"/v1/models": _models(str(tmp_path)), "/collective_rpc": _versions(None, False)})
    with pytest.raises(RuntimeError, match="has no rlwire weight transfer; start it with"):
        VLLMServer(server.url, timeout=5).check_serves(str(tmp_path))


def test_a_server_that_is_down_is_named():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(
        RuntimeError, match=f"vllm_server {url}: no answer to /v1/models within 5 s"
    ):
        VLLMServer(url, timeout=5).check_serves("/m")


def test_completions_are_read_in_choice_order_with_their_logprobs(fake):
    def choice(index, tokens, values, finish):
        return {
            "index": index,
            "token_ids": tokens,
            "logprobs": {"token_logprobs": values},
            "finish_reason": finish,
        }

    choices = [choice(1, [7], [-0.5], "length"), choice(0, [4, 2], [-1.0, -2.0], "stop")]
    server = fake({"/v1/completions": (200, {"choices": choices})})
    client = VLLMServer(server.url, timeout=5)
    assert client.complete({"prompt": [[1]]}, expected=2) == [
        ([4, 2], [-1.0, -2.0], "stop"),
        ([7], [-0.5], "length"),
    ]
    with pytest.raises(RuntimeError, match="2 completions for 3 requested"):
        client.complete({"prompt": [[1]]}, expected=3)
    choices[0]["logprobs"]["token_logprobs"] = []
    with pytest.raises(RuntimeError, match="0 log-probs for 1 tokens"):
        client.complete({"prompt": [[1]]}, expected=2)


def test_an_update_is_received_then_written_in_with_its_version(fake):
    routes = {
        "/start_weight_update": (200, {}),
        "/update_weights": (200, {}),
        "/collective_rpc": (200, {"results": [{"held": None, "staged": 4, "rlwire": True}]}),
        "/finish_weight_update": (200, {}),
        "/reset_prefix_cache": (200, {}),
    }
    server = fake(routes)
    client = VLLMServer(server.url, timeout=5)
    assert client.receive_update() == 4
    client.finish_update(4)
    assert [p for p, _ in server.posts] == [
        "/start_weight_update",
        "/update_weights",
        "/collective_rpc",
        "/finish_weight_update",
        "/reset_prefix_cache",
    ]
    assert server.posts[1][1] == {"update_info": {}}
    assert server.posts[3][1] == {"weight_version": "4"}


def test_an_update_longer_than_request_timeout_is_received_while_the_server_answers(fake):
    routes = {
        "/health": (200, {}),
        "/start_weight_update": (200, {}),
        "/update_weights": (200, {}, 3.0),  # the transfer: three times the request timeout
        "/collective_rpc": (200, {"results": [{"held": None, "staged": 5, "rlwire": True}]}),
    }
    client = VLLMServer(fake(routes).url, timeout=1)
    before = client.progressed_at
    assert client.receive_update(poll=0.25) == 5  # before: "no answer ... within 1 s"
    assert client.progressed_at > before  # /health answered meanwhile: progress


def test_an_update_fails_naming_the_server_once_it_stops_answering_health(fake):
    """A server that leaves ``/health`` unanswered for ``health_timeout`` during an update
    is lost (:class:`EngineLost`, naming it and the setting), not waited for: the update's
    answer is held back until the loss was raised, and the call it left still waits then."""
    from rlwire.trainer.rollout import EngineLost

    routes = HeldRoutes(
        {"/health": (503, {}), "/start_weight_update": (200, {}), "/update_weights": (200, {})},
        held="/update_weights",
    )
    server = fake(routes)
    client = VLLMServer(server.url, timeout=30, health_timeout=1.0, index=3)
    before = set(threading.enumerate())
    try:
        with pytest.raises(EngineLost, match=r"no answer to /health for \d+ s while it received "
                           r"an update \(rollout.vllm.health_timeout: 1 s\)") as lost:  # fmt: skip
            client.receive_update(poll=0.25)
        assert lost.value.index == 3
        assert routes.asked.wait(30), "/update_weights was never asked"
        calls = [t for t in set(threading.enumerate()) - before if t.name == "rlwire-vllm-update"]
        assert len(calls) == 1 and calls[0].is_alive()  # still waiting for the answer
    finally:
        routes.released.set()
    calls[0].join(timeout=30)  # the call it left: ends now that the stand-in answers
    assert not calls[0].is_alive()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.server_urls=[http://a:1]"], "set it with rollout.backend=vllm_server only"),
        (
            ["rollout.backend=vllm_server", "rollout.server_urls=[http://a:1,http://b:2]"],
            "give one per rollout worker (rollout.num_workers=1)",
        ),
        (["rollout.backend=vllm_server", "rollout.server_urls=[a:1]"], "use http://host:port URLs"),
        (["rollout.vllm.request_timeout=0"], "use seconds > 0"),
        (["rollout.vllm.health_timeout=-1"], "rollout.vllm.health_timeout: -1.0"),
        (["rollout.backend=vllm_server", "actor.lora.rank=8"], "does not take LoRA adapters"),
    ],
)
def test_bad_server_settings_are_refused_at_config_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=overrides)


def test_servers_given_one_per_worker_are_taken():
    config = load_config(
        overrides=[
            "rollout.backend=vllm_server",
            "rollout.num_workers=2",
            "rollout.server_urls=[http://10.0.0.1:8000,http://10.0.0.2:8000]",
        ]
    )
    assert config.rollout.server_urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


# --- a server the run starts takes weights from the run only ---------------------------------


def test_a_server_that_refuses_connections_is_lost_naming_it():
    """A refused connection is a lost server (:class:`EngineLost`, which the job heals),
    not a run-stopping error."""
    import socket

    from rlwire.trainer.rollout import EngineLost

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(EngineLost, match=f"vllm_server {url}: no answer to /v1/models") as lost:
        VLLMServer(url, timeout=5, index=1).check_serves("/m")
    assert lost.value.index == 1


def test_the_token_goes_with_every_call_and_in_the_init_info(fake, tmp_path):
    token = "ab" * 32
    routes = {
        "/v1/models": _models(str(tmp_path)),
        "/collective_rpc": _versions(None),
        "/init_weight_transfer_engine": (200, {}),
    }
    server = fake(routes)
    client = VLLMServer(server.url, timeout=5, token=token)
    client.check_serves(str(tmp_path))
    client.init_weight_transfer("shm", rank=1, world_size=2, metadata={"port": 1}, timeout=5)
    assert [a for _, a in server.auth] == [f"Bearer {token}"] * 4
    info = server.posts[-1][1]["init_info"]
    assert info["token"] == token and info["backend"] == "rlwire_shm"
    # before the init, an update a lost worker left open on the server is ended
    assert server.posts[-2] == ("/collective_rpc", {"method": "rlwire_end_update"})
    # a server of the user's, without a token: nothing is sent
    plain = fake(routes)
    VLLMServer(plain.url, timeout=5).init_weight_transfer(
        "gloo", rank=1, world_size=2, metadata={}, timeout=5
    )
    assert plain.auth == [("/collective_rpc", None), ("/init_weight_transfer_engine", None)]
    assert "token" not in plain.posts[-1][1]["init_info"]


def test_a_server_the_run_starts_names_its_backend_loopback_and_the_guard_and_no_secret():
    config = load_config(overrides=["rollout.backend=vllm_server"])
    command = server_command(config, "/m", backend="shm", port=8123, on_gpu=False)
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {
        "backend": "rlwire_shm"  # never "rlwire", which takes whichever backend a caller names
    }
    assert command[command.index("--middleware") + 1] == GUARD
    assert "RLWIRE_WEIGHT_TRANSFER_TOKEN" in SERVER_FLAGS and GUARD in SERVER_FLAGS
    with pytest.raises(ValueError, match="the run's resolved one, not 'auto'"):
        ServerProcess.start(config, "/m", backend="auto")


def _tmp_logs() -> set[str]:
    import glob
    import tempfile

    return set(glob.glob(os.path.join(tempfile.gettempdir(), "rlwire-vllm-server-*")))


def test_the_servers_log_has_no_name_and_is_closed_with_it():
    """The server's output goes to a file without a name: nothing in /tmp while it runs or
    after (a killed worker leaves nothing either), no descriptor left open after stop()."""
    before_logs, before_fds = _tmp_logs(), set(os.listdir("/proc/self/fd"))
    command = [sys.executable, "-c", "print('serving', flush=True); import time; time.sleep(60)"]
    server = ServerProcess.launch(command, dict(os.environ), url="http://127.0.0.1:1", token="t")
    try:
        deadline = time.monotonic() + 60
        while "serving" not in server.tail():
            assert server.process.poll() is None, server.tail()
            assert time.monotonic() < deadline, "the command printed nothing within 60 s"
            time.sleep(0.1)
        assert _tmp_logs() == before_logs
    finally:
        server.stop()
    assert server.process.poll() is not None
    assert set(os.listdir("/proc/self/fd")) == before_fds
    assert _tmp_logs() == before_logs


_BINDS = (  # what vLLM's engine does with VLLM_RPC_BASE_PATH: a ZMQ ipc socket file there
    "import os, socket, stat, time\n"
    "where = os.environ['VLLM_RPC_BASE_PATH']\n"
    "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(where, 'engine-core'))\n"
    "print('rpc', where, oct(stat.S_IMODE(os.stat(where).st_mode)), flush=True)\n"
    "time.sleep(60)\n"
)


def _rpc_line(server: ServerProcess) -> list[str]:
    deadline = time.monotonic() + 60
    while not (lines := [x for x in server.tail().splitlines() if x.startswith("rpc ")]):
        assert server.process.poll() is None, server.tail()
        assert time.monotonic() < deadline, "the command printed nothing within 60 s"
        time.sleep(0.1)
    return lines[0].split()


def test_a_servers_sockets_go_in_a_private_directory_removed_with_it(tmp_path):
    """vLLM's ZMQ sockets (``VLLM_RPC_BASE_PATH``) go in a directory of the watchdog's own
    (``0o700``), not the temp dir; it is removed when the server stops, and after a
    watchdog killed outright, by the next one's sweep."""
    import signal
    import tempfile
    from pathlib import Path

    from rlwire.trainer.rollout.vllm import RPC_PREFIX, rpc_dir

    command = [sys.executable, "-c", _BINDS]
    server = ServerProcess.launch(command, dict(os.environ), url="http://127.0.0.1:1", token="t")
    try:
        _, where, mode = _rpc_line(server)
        rpc = Path(where)
        assert rpc.parent == Path(tempfile.gettempdir()) and mode == "0o700"
        assert rpc.name.startswith(f"{RPC_PREFIX}{server.process.pid}-")  # the watchdog's
        assert [p.name for p in rpc.iterdir()] == ["engine-core"]
    finally:
        server.stop()
    assert not rpc.exists()
    killed = ServerProcess.launch(command, dict(os.environ), url="http://127.0.0.1:1", token="t")
    try:
        left = Path(_rpc_line(killed)[1])
        killed.process.send_signal(signal.SIGKILL)  # no finally runs in the watchdog
        killed.process.wait(timeout=60)
        assert left.exists()
        swept = rpc_dir()
        swept.close()
        assert left in swept.swept and not left.exists()
    finally:
        killed.stop()


# --- answers bounded in size and checked in shape (issue 70, item 6) --------------------------


def test_an_answer_longer_than_the_bound_is_refused_naming_it(fake, monkeypatch):
    """Refused on its ``Content-Length`` before it is read, or, where it states none, once
    more than the bound arrived (before: read whole, whatever its size)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rlwire.trainer.rollout import vllm_http

    monkeypatch.setattr(vllm_http, "MAX_ANSWER_BYTES", 1024)
    choices = [{"index": 0, "token_ids": [1] * 300, "logprobs": {"token_logprobs": [-1.0] * 300},
                "finish_reason": "length"}]  # fmt: skip
    server = fake({"/v1/completions": (200, {"choices": choices})})
    size = len(json.dumps({"choices": choices}))
    with pytest.raises(RuntimeError) as err:
        VLLMServer(server.url, timeout=5).complete({"prompt": [[1]]}, expected=1)
    assert str(err.value) == (
        f"vllm_server {server.url}: /v1/completions answered {size} bytes, more than the 1024 "
        "an answer may hold (MAX_ANSWER_BYTES)"
    )

    class Unsized(BaseHTTPRequestHandler):  # HTTP/1.0: the body ends when the connection does
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"data": [' + b'{"id": "m"},' * 100_000 + b"]}")

        def log_message(self, *args) -> None:
            """Quiet."""

    unsized = ThreadingHTTPServer(("127.0.0.1", 0), Unsized)
    threading.Thread(target=unsized.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{unsized.server_address[1]}"
    try:
        with pytest.raises(RuntimeError) as err:
            VLLMServer(url, timeout=5).check_serves("/m")
    finally:
        unsized.shutdown()
        unsized.server_close()
    assert str(err.value) == (
        f"vllm_server {url}: /v1/models answered more than the 1024 bytes an answer may hold "
        "(MAX_ANSWER_BYTES)"
    )


_MODELS_SHAPE = '{"data": [{"id": str, "root": str or null}, ...]}'
_VERSIONS_SHAPE = (
    '{"results": [{"rlwire": bool, "held": int or null, "staged": int or null}]} (one worker)'
)
_COMPLETIONS_SHAPE = (
    '{"choices": [{"index": int, "token_ids": [int, ...], "logprobs": {"token_logprobs": '
    '[number, ...]}, "finish_reason": str}, ...]}'
)


@pytest.mark.parametrize(
    ("path", "answer", "shape"),
    [
        ("/v1/models", {"data": "m"}, _MODELS_SHAPE),  # before: TypeError
        ("/v1/models", {"data": [{"id": 5}]}, _MODELS_SHAPE),  # before: TypeError (Path(5))
        ("/v1/models", [], _MODELS_SHAPE),  # before: TypeError
        ("/collective_rpc", {"results": []}, _VERSIONS_SHAPE),  # before: ValueError (unpack)
        ("/collective_rpc", {"results": [{"rlwire": True, "held": "7", "staged": None}]},
         _VERSIONS_SHAPE),  # before: taken, "serves weights version 7"
        ("/collective_rpc", {"results": [{"held": None, "staged": None}]},
         _VERSIONS_SHAPE),  # before: KeyError
    ],
)  # fmt: skip
def test_a_servers_answers_not_of_the_shape_read_are_refused_at_start(fake, tmp_path, path,
                                                                       answer, shape):  # fmt: skip
    routes = {"/v1/models": _models(str(tmp_path)), "/collective_rpc": _versions(None)}
    server = fake({**routes, path: (200, answer)})
    with pytest.raises(RuntimeError) as err:
        VLLMServer(server.url, timeout=5).check_serves(str(tmp_path))
    assert type(err.value) is RuntimeError
    assert str(err.value) == (
        f"vllm_server {server.url}: {path} answered {json.dumps(answer)}, not {shape}"
    )


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": {"index": 0}},  # before: TypeError
        {"choices": [{"index": 0, "token_ids": [1], "logprobs": None, "finish_reason": "stop"}]},
        {
            "choices": [
                {
                    "index": "0",
                    "token_ids": [1],
                    "logprobs": {"token_logprobs": [-1.0]},
                    "finish_reason": "stop",
                }
            ]
        },  # fmt: skip
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": ["a"],
                    "logprobs": {"token_logprobs": [-1.0]},
                    "finish_reason": "stop",
                }
            ]
        },  # before: taken, a str as a token id  # fmt: skip
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": [1],
                    "logprobs": {"token_logprobs": [None]},
                    "finish_reason": "stop",
                }
            ]
        },  # before: taken, None as a log-prob  # fmt: skip
        {"choices": [{"index": 0, "token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}]},
    ],
)
def test_a_completion_not_of_the_shape_read_is_refused_naming_it(fake, answer):
    server = fake({"/v1/completions": (200, answer)})
    with pytest.raises(RuntimeError) as err:
        VLLMServer(server.url, timeout=5).complete({"prompt": [[1]]}, expected=1)
    assert type(err.value) is RuntimeError
    shown = json.dumps(answer)
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    assert str(err.value) == (
        f"vllm_server {server.url}: /v1/completions answered {shown}, not {_COMPLETIONS_SHAPE}"
    )


def test_an_update_whose_versions_are_not_of_the_shape_read_is_refused_naming_it(fake):
    routes = {"/start_weight_update": (200, {}), "/update_weights": (200, {})}
    staged = {"results": [{"held": None, "staged": "4", "rlwire": True}]}  # before: int("4")
    server = fake({**routes, "/collective_rpc": (200, staged)})
    with pytest.raises(RuntimeError) as err:
        VLLMServer(server.url, timeout=5).receive_update()
    assert str(err.value) == (
        f"vllm_server {server.url}: /collective_rpc answered {json.dumps(staged)}, not "
        f"{_VERSIONS_SHAPE}"
    )
    none = {"results": [{"held": None, "staged": None, "rlwire": True}]}  # before: int(None)
    server = fake({**routes, "/collective_rpc": (200, none)})
    with pytest.raises(RuntimeError) as err:
        VLLMServer(server.url, timeout=5).receive_update()
    assert str(err.value) == (
        f"vllm_server {server.url}: /update_weights answered, but the server holds no received "
        "update (rlwire_weight_versions: staged is null)"
    )
