"""The agent endpoint's limits (issue 64, item 12): a start that fails leaves no socket and no
thread behind, a body is read only up to its limit (413, and the server goes on), and an
endpoint listening beyond loopback is warned about once, naming the key."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import threading

import pytest

from rlwire.trainer.agent.endpoint import Endpoint
from rlwire.trainer.agent.lookup import build_lookup_tokenizer
from rlwire.trainer.agent.parsers import HermesParser
from rlwire.trainer.rollout.listeners import held_sockets, listening_sockets
from rlwire.trainer.rollout.requests import Completion


def _submit(request) -> concurrent.futures.Future:
    """An engine that answers every request with one token at once."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(Completion("r", [5], [-0.5], [0], "length"))
    return done


def _endpoint(**kwargs) -> Endpoint:
    return Endpoint(
        _submit, build_lookup_tokenizer(), HermesParser(), temperature=1.0, max_new_tokens=4,
        timeout=10, **kwargs,
    )  # fmt: skip


def _held() -> set[int]:
    """The sockets this process holds (a bound socket never listened on is in no table of
    /proc/net: only its descriptor shows it)."""
    return held_sockets({os.getpid()})


def _listening() -> set[int]:
    """The sockets this process holds that listen (connections the test session's other
    code opens or closes meanwhile are left out)."""
    return _held() & set(listening_sockets())


def _endpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rlwire-endpoint" and t.is_alive()]


def test_a_start_that_fails_after_binding_leaves_no_socket():
    endpoint, before = _endpoint(), _held()

    def broken():
        raise RuntimeError("no app today")

    endpoint.app = broken  # type: ignore[method-assign]  # a step after the bind fails
    with pytest.raises(RuntimeError, match="no app today"):
        endpoint.start()
    assert _held() == before  # before the fix: one bound socket more, never closed


def test_a_start_that_times_out_stops_its_server_and_closes_its_socket(monkeypatch):
    """The server comes up after the start gave up on it: it must not come up at all. The
    check waits for the slow startup to have ended, when a server left running listens."""
    import uvicorn

    startup = uvicorn.Server.startup
    over = threading.Event()

    async def slow(self, sockets=None):
        import asyncio

        try:
            await asyncio.sleep(0.5)
            await startup(self, sockets=sockets)
        finally:
            over.set()

    monkeypatch.setattr(uvicorn.Server, "startup", slow)
    endpoint, before = _endpoint(), _listening()
    with pytest.raises(
        RuntimeError, match=r"agent endpoint: did not start on 127.0.0.1:0 in 0.1 s"
    ):
        endpoint.start(timeout=0.1)
    assert over.wait(60), "the server's slow startup did not end within 60 s"
    assert _listening() == before and _endpoint_threads() == []


def _post(url: str, path: str, key: str, body: bytes, *, chunked: bool = False):
    host, port = url.split("//")[1].split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    # the server may answer and close before the whole body is sent: its answer is read
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if chunked:  # no Content-Length: the server counts what arrives
            parts = iter([body[i : i + 4096] for i in range(0, len(body), 4096)])
            connection.request("POST", path, body=parts, headers=headers, encode_chunked=True)
        else:
            connection.request("POST", path, body=body, headers=headers)
    try:
        answer = connection.getresponse()
        raw = answer.read()
    finally:
        connection.close()
    try:
        return answer.status, json.loads(raw)
    except ValueError:  # not the endpoint's own answer (a server error's plain text)
        return answer.status, {"error": {"message": raw.decode(errors="replace")}}


@pytest.fixture
def small():
    """An endpoint whose bodies may hold 1000 bytes, and a session of it."""
    endpoint = _endpoint(max_body=1000)
    url = endpoint.start()
    yield endpoint, url, endpoint.sessions.open(seed=0)
    endpoint.stop()


def _completion(size: int) -> bytes:
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1, "user": ""}).encode()
    return body[:-2] + b"x" * (size - len(body)) + body[-2:]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused_413_and_the_server_goes_on(small, chunked):
    endpoint, url, session = small
    status, answer = _post(url, "/v1/completions", session.key, _completion(1000))
    assert status == 200 and answer["choices"][0]["token_ids"] == [5]  # at the limit: taken
    status, answer = _post(
        url, "/v1/completions", session.key, _completion(1001 if chunked else 200_000),
        chunked=chunked,
    )  # fmt: skip
    assert status == 413
    assert answer["error"]["message"] == (
        "the body is over 1000 bytes, the endpoint's limit (MAX_BODY_BYTES)"
    )
    status, answer = _post(url, "/v1/completions", session.key, _completion(100))
    assert status == 200 and answer["prompt_token_ids"] == [5, 6, 7]
    assert len(endpoint.sessions.close(session)) == 2  # the refused call left nothing


def test_a_body_is_not_read_without_a_sessions_key(small):
    _, url, _ = small
    status, answer = _post(url, "/v1/completions", "rlwire-session-guessed", _completion(5000))
    assert status == 401 and "unknown or ended session" in answer["error"]["message"]


def test_a_deeply_nested_body_is_refused_400_not_a_server_error():
    endpoint = _endpoint()
    url, session = endpoint.start(), endpoint.sessions.open(seed=0)
    try:
        deep = b"[" * 50_000 + b"]" * 50_000  # past the parser's recursion limit
        status, answer = _post(url, "/v1/completions", session.key, deep)
        assert (status, answer["error"]["message"]) == (400, "the body is not JSON")
        deep = b'{"prompt": [5], "x": ' + b"[" * 100 + b"]" * 100 + b"}"  # parsed, too deep
        status, answer = _post(url, "/v1/completions", session.key, deep)
        assert status == 400
        assert answer["error"]["message"] == "the body is nested deeper than 64 levels"
    finally:
        endpoint.stop()


def test_an_endpoint_beyond_loopback_is_warned_about_once_naming_the_key():
    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.driver import run_warnings

    function = "agent.function=rlwire.trainer.agent.lookup_agent:solve"
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        config = load_config(overrides=[function, f"agent.endpoint_host='{host}'"])
        assert run_warnings(config) == []
    for host in ("0.0.0.0", "::", "10.1.2.3", "node7.cluster"):
        config = load_config(overrides=[function, f"agent.endpoint_host='{host}'"])
        assert run_warnings(config) == [
            f"agent.endpoint_host={host}: each rollout worker's agent endpoint listens beyond "
            f"this machine, reachable by whoever can reach {host}; every call needs a "
            "session's key, but keep it on loopback (127.0.0.1, the default) unless agents "
            "call it from other machines"
        ]
    # no endpoint without agent.function: nothing to warn about
    assert run_warnings(load_config(overrides=["agent.endpoint_host=0.0.0.0"])) == []
