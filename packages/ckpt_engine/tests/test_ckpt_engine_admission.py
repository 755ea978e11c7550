"""A server's weight-transfer token (``RLWIRE_WEIGHT_TRANSFER_TOKEN``): who may hand its
receiver an init, which options it takes from the caller, and the HTTP guard in front of
its routes. Without vLLM (the real server: ``test_ckpt_engine_vllm.py``, marked ``vllm``)."""

from __future__ import annotations

import asyncio
import json
import secrets

import pytest

from rlwire.ckpt_engine import WEIGHT_TRANSFER_TOKEN_ENV, CheckpointEngineError
from rlwire.ckpt_engine._admission import TokenGuard, admit, required_token

TOKEN = secrets.token_hex(32)


def test_a_server_with_a_token_admits_only_that_token_and_no_caller_options():
    admit(required=TOKEN, token=TOKEN, options={}, name="rlwire_shm")
    with pytest.raises(
        CheckpointEngineError,
        match=r"^rlwire_shm: init_weight_transfer_engine refused: this server takes weights only "
        r"from the run that started it and the init info carries no token \(its "
        r"RLWIRE_WEIGHT_TRANSFER_TOKEN\)$",
    ):
        admit(required=TOKEN, token=None, options={}, name="rlwire_shm")
    for wrong in ("", TOKEN[:-1], TOKEN + "0", secrets.token_hex(32)):
        with pytest.raises(CheckpointEngineError, match="refused: this server takes weights only"):
            admit(required=TOKEN, token=wrong, options={}, name="rlwire_shm")
    with pytest.raises(
        CheckpointEngineError,
        match=r"^rlwire_filesystem: init_weight_transfer_engine refused: options \['root'\] are "
        r"not taken from the caller by a server that requires a token \(allowed: none\)",
    ):
        admit(required=TOKEN, token=TOKEN, options={"root": "/"}, name="rlwire_filesystem")


def test_a_server_without_a_token_admits_any_caller_as_before():
    admit(required=None, token=None, options={"root": "/tmp/x"}, name="rlwire")
    admit(required=None, token="anything", options={}, name="rlwire")


def test_the_token_is_read_from_the_environment_and_empty_is_none():
    assert required_token({WEIGHT_TRANSFER_TOKEN_ENV: TOKEN}) == TOKEN
    assert required_token({WEIGHT_TRANSFER_TOKEN_ENV: ""}) is None
    assert required_token({}) is None
    assert WEIGHT_TRANSFER_TOKEN_ENV == "RLWIRE_WEIGHT_TRANSFER_TOKEN"


def _request(guard: TokenGuard, path: str, headers: list[tuple[bytes, bytes]]) -> tuple:
    """One HTTP request through ``guard``: (status, body) and whether the app was reached."""
    reached, sent = [], []

    async def app(scope, receive, send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    guard.app = app
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"], sent[1]["body"], bool(reached)


def test_the_guard_lets_only_the_token_past_every_route_but_health():
    guard = TokenGuard(None, token=TOKEN)  # type: ignore[arg-type]  # set per request below
    bearer = [(b"authorization", f"Bearer {TOKEN}".encode())]
    for path in ("/collective_rpc", "/init_weight_transfer_engine", "/update_weights",
                 "/v1/completions", "/health/../collective_rpc"):  # fmt: skip
        for headers in ([], [(b"authorization", b"Bearer " + b"0" * 64)], [(b"x", b"y")]):
            status, body, reached = _request(guard, path, headers)
            assert (status, reached) == (401, False), path
            assert (
                "requires its weight-transfer token (RLWIRE_WEIGHT_TRANSFER_TOKEN)"
                in (json.loads(body)["error"])
            )
        assert _request(guard, path, bearer) == (200, b"ok", True)
    assert _request(guard, "/health", []) == (200, b"ok", True)


def test_a_guard_without_a_token_refuses_to_start(monkeypatch):
    monkeypatch.delenv(WEIGHT_TRANSFER_TOKEN_ENV, raising=False)
    with pytest.raises(CheckpointEngineError, match="^TokenGuard: RLWIRE_WEIGHT_TRANSFER_TOKEN is"):
        TokenGuard(None)  # type: ignore[arg-type]
    monkeypatch.setenv(WEIGHT_TRANSFER_TOKEN_ENV, TOKEN)
    assert _request(TokenGuard(None), "/x", [(b"Authorization", f"Bearer {TOKEN}".encode())])[2]  # type: ignore[arg-type]
