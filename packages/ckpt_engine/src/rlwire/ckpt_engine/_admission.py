"""Who may hand a receiver its weights: the weight-transfer token of a server a run started.

A receiver inside a server (vLLM's ``vllm serve``, :mod:`rlwire.ckpt_engine.vllm`) is told
where to connect and with which secret by whoever calls its ``init_weight_transfer_engine``
route; that caller becomes its sender. A run that starts the server puts a fresh token in
the server's environment (:data:`TOKEN_ENV`, never on the command line, where every user of
the host can read it) and hands the same token in the init info: the receiver takes an
init only with that token (:func:`admit`), and :class:`TokenGuard` (an ASGI middleware,
``vllm serve --middleware``) refuses every other route to a request without it, as
``Authorization: Bearer <token>``. A server started without the variable takes any caller,
as before: that is the user's own server, on an address the user chose.

vLLM-free (the stdlib only): the receiver and its tests use it without vLLM.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ._errors import CheckpointEngineError

__all__ = ["CALLER_OPTIONS", "OPEN_PATHS", "TOKEN_ENV", "TokenGuard", "admit", "required_token"]

TOKEN_ENV = "RLWIRE_WEIGHT_TRANSFER_TOKEN"
"""The environment variable that holds a server's weight-transfer token (a run draws
``secrets.token_hex(32)``); set on the server it makes :func:`admit` and :class:`TokenGuard`
demand it, set on the caller's side it is sent."""

CALLER_OPTIONS: frozenset[str] = frozenset()
"""Backend options a server that requires a token takes from the caller: none. Its
receiver's settings are its own; the one option the backends take from a caller, the
``filesystem`` backend's ``root``, names a directory the receiver would create, write its
acknowledgements into and load weights from: the caller's choice of a place on the
server's host."""

OPEN_PATHS = frozenset({"/health"})
"""Routes :class:`TokenGuard` answers without the token (a liveness probe only)."""


def required_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The token this process demands (:data:`TOKEN_ENV`), or None when it is unset or
    empty: a server started without one."""
    return (os.environ if environ is None else environ).get(TOKEN_ENV) or None


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())  # constant time


def admit(
    *, required: str | None, token: str | None, options: Mapping[str, Any], name: str
) -> None:
    """Refuse an init whose caller is not the run that started this server.

    Args:
        required: the token this server demands (:func:`required_token`); None takes any
            caller, with any options, as a server the user started.
        token: the one the init info carries.
        options: the backend options the init info carries (only :data:`CALLER_OPTIONS`
            are taken when a token is required).
        name: the engine, first in the message.

    Raises:
        CheckpointEngineError: one line naming what is refused and what is allowed.
    """
    if required is None:
        return
    if not isinstance(token, str) or not token:
        raise CheckpointEngineError(
            f"{name}: init_weight_transfer_engine refused: this server takes weights only "
            f"from the run that started it and the init info carries no token (its {TOKEN_ENV})"
        )
    if not _same(token, required):
        raise CheckpointEngineError(
            f"{name}: init_weight_transfer_engine refused: this server takes weights only "
            f"from the run that started it and the init info's token is not its {TOKEN_ENV}"
        )
    refused = sorted(str(key) for key in options if key not in CALLER_OPTIONS)
    if refused:
        allowed = ", ".join(sorted(CALLER_OPTIONS)) or "none"
        raise CheckpointEngineError(
            f"{name}: init_weight_transfer_engine refused: options {refused} are not taken "
            f"from the caller by a server that requires a token (allowed: {allowed}); its "
            "receiver's settings are its own (the filesystem backend's root is not offered)"
        )


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class TokenGuard:
    """ASGI middleware: every route but :data:`OPEN_PATHS` needs ``Authorization: Bearer
    <token>``; any other request is answered 401 with one line saying so.

    vLLM's weight-transfer and RPC routes (``VLLM_SERVER_DEV_MODE=1``) carry no key of their
    own: ``/collective_rpc`` alone calls any worker method, ``reload_weights`` from any
    path included. ``vllm serve --middleware rlwire.ckpt_engine.vllm.TokenGuard`` puts them
    (and the OpenAI routes) behind the server's token.

    Args:
        app: the application it guards (Starlette passes it).
        token: the token; default :data:`TOKEN_ENV` of this process, which must be set.

    Raises:
        CheckpointEngineError: no token: the server would start unguarded.
    """

    def __init__(self, app: App, token: str | None = None) -> None:
        expected = token or required_token()
        if not expected:
            raise CheckpointEngineError(
                f"TokenGuard: {TOKEN_ENV} is not set in the server's environment; set it to "
                "the run's weight-transfer token (or leave out --middleware "
                "rlwire.ckpt_engine.vllm.TokenGuard)"
            )
        self.app = app
        self._expected = "Bearer " + expected

    def allowed(self, scope: Scope) -> bool:
        """Whether ``scope`` (an HTTP or websocket request) may pass."""
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if path in OPEN_PATHS:
            return True
        for key, value in scope.get("headers", ()):
            if bytes(key).lower() == b"authorization":
                return _same(bytes(value).decode("latin-1"), self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps(
            {
                "error": f"rlwire: this server requires its weight-transfer token "
                f"({TOKEN_ENV}) as 'Authorization: Bearer <token>' on every route but "
                f"{', '.join(sorted(OPEN_PATHS))}"
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
