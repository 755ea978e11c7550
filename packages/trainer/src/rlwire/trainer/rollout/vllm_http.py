"""A ``vllm serve`` server as the ``vllm_server`` rollout engine sees it: the HTTP calls it
makes, every one bounded in time, every failure naming the server (the server process a
rollout worker starts when no URL is given: :mod:`.vllm_process`).

A server a worker starts takes weights only from this run: a fresh token
(``secrets.token_hex(32)``) goes into its environment (``RLWIRE_WEIGHT_TRANSFER_TOKEN``, not
its command line, which every user of the host can read), its weight-transfer engine takes an
init only with that token, and rlwire's guard (``--middleware``) refuses every route but
``/health`` to a request without it; the server listens on loopback.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rlwire.ckpt_engine import DEFAULT_TIMEOUT_S, WEIGHT_TRANSFER_TOKEN_ENV

from .base import EngineLost
from .vllm import transfer_init_info

__all__ = ["EXTENSION", "GUARD", "MAX_ANSWER_BYTES", "SERVER_FLAGS", "VLLMServer"]

log = logging.getLogger("rlwire.trainer")

EXTENSION = "rlwire.ckpt_engine.vllm.WorkerExtension"
GUARD = "rlwire.ckpt_engine.vllm.TokenGuard"
SERVER_FLAGS = (
    f"VLLM_SERVER_DEV_MODE=1 (vLLM's weight-transfer and RPC routes), --weight-transfer-config "
    f'\'{{"backend": "rlwire_<ckpt_engine.backend>"}}\' and --worker-extension-cls {EXTENSION} '
    f"(and {WEIGHT_TRANSFER_TOKEN_ENV} in its environment and this run's, with --middleware "
    f"{GUARD})"
)

MAX_ANSWER_BYTES = 64 << 20
"""Bytes of one answer a server may send (its body); a longer one is refused before more
of it is read, as a ``RuntimeError`` naming the server. The largest answer the run asks
for is a completion, whose sampled ids and their log-probs take about 100 bytes a token
in vLLM's fields: 64 MiB holds some 600,000 tokens, far past any context a run samples."""
_ERROR_BYTES = 4096
"""Bytes of an error answer's body read (its first 500 characters are shown)."""


class VLLMServer:
    """The calls the rollout engine makes to one server at ``url``; ``token``: its
    weight-transfer token, sent with every call (``Authorization: Bearer``) and in the init
    info, for a server that demands one."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        token: str | None = None,
        index: int = 0,
        health_timeout: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.health_timeout = timeout if health_timeout is None else min(timeout, health_timeout)
        """Seconds the server may leave ``/health`` unanswered during an update, and the
        bound of a call that does no work of its own length (a weight commit, a reset):
        past it, the server is lost."""
        self.token = token or None
        self.index = index
        """The rollout worker's index (named by :class:`~.base.EngineLost`)."""
        self.model_name: str | None = None
        self.progressed_at = time.monotonic()
        """When the update being received last moved (``time.monotonic()``): the server
        answered ``/health`` during it (:meth:`receive_update`)."""
        self.update_timeout = _update_bound(DEFAULT_TIMEOUT_S)
        """Seconds one whole update may take (:meth:`receive_update`): twice the
        checkpoint engine's ``timeout`` and 30 s, set when the server joins its group
        (:meth:`init_weight_transfer`)."""

    def _call(
        self,
        path: str,
        body: dict | None = None,
        *,
        timeout: float | None = None,
        shape: _Shape | None = None,
    ) -> Any:
        """``path``'s JSON answer, waiting ``timeout`` seconds (``request_timeout`` by
        default), at most :data:`MAX_ANSWER_BYTES` of it, of ``shape`` where one is given.

        Raises:
            RuntimeError: an error status, an answer too long, not JSON or not of
                ``shape``, naming the server and the path.
            EngineLost: no answer in time, or not an HTTP one.
        """
        wait = self.timeout if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token and path != "/health":  # /health is open: asked without the token
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            self.url + path, data=data, method="GET" if body is None else "POST", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=wait) as answer:
                raw = self._read(path, answer)
        except urllib.error.HTTPError as err:
            detail = err.read(_ERROR_BYTES).decode(errors="replace")[:500]
            raise RuntimeError(
                f"vllm_server {self.url}: {path} answered {err.code}: {detail}"
            ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            reason = getattr(err, "reason", err)
            raise EngineLost(
                f"vllm_server {self.url}: no answer to {path} within {wait:g} s ({reason})",
                self.index,
            ) from None
        except http.client.HTTPException as err:  # a malformed answer: no server's answer
            raise EngineLost(
                f"vllm_server {self.url}: {path}: not an HTTP answer ({type(err).__name__})",
                self.index,
            ) from None
        try:
            out = json.loads(raw) if raw else None
        except ValueError:
            raise RuntimeError(
                f"vllm_server {self.url}: {path} answered something other than JSON: {raw[:80]!r}"
            ) from None
        return out if shape is None else self._shaped(path, out, shape)

    def _shaped(self, path: str, answer: Any, shape: _Shape) -> Any:
        """``answer`` if it has ``shape``, else a ``RuntimeError`` naming both."""
        if not shape.holds(answer):
            shown = json.dumps(answer)
            shown = shown if len(shown) <= 120 else shown[:117] + "..."
            raise RuntimeError(f"vllm_server {self.url}: {path} answered {shown}, not {shape.text}")
        return answer

    def _read(self, path: str, answer) -> bytes:
        """An answer's body, at most :data:`MAX_ANSWER_BYTES`: refused on its
        ``Content-Length`` before it is read, or once more arrived where it states none."""
        limit = MAX_ANSWER_BYTES
        stated = answer.headers.get("Content-Length")
        if stated is not None and stated.strip().isdigit() and int(stated) > limit:
            raise RuntimeError(
                f"vllm_server {self.url}: {path} answered {int(stated)} bytes, more than the "
                f"{limit} an answer may hold (MAX_ANSWER_BYTES)"
            )
        raw = answer.read(limit + 1)
        if len(raw) > limit:
            raise RuntimeError(
                f"vllm_server {self.url}: {path} answered more than the {limit} bytes an "
                "answer may hold (MAX_ANSWER_BYTES)"
            )
        return raw

    def healthy(self) -> bool:
        try:
            self._call("/health", timeout=5)
        except RuntimeError:
            return False
        return True

    def wait_answering(self, *, first: float = 1.0, most: float = 30.0) -> None:
        """Wait for the server to answer ``/health`` again, asking at growing intervals
        (``first`` seconds, doubled each time, ``most`` at most), each try logged. No
        deadline of its own: a replacement waits while the run goes on without it, and the
        run bounds what it waits for (:meth:`~rlwire.trainer.runtime.healing.Fleet.
        wait_loaded`)."""
        pause, tries, since = first, 0, time.monotonic()
        while not self.healthy():
            tries += 1
            log.warning(
                "vllm_server %s: no answer to /health for %.0f s (try %d); asking again in "
                "%.0f s", self.url, time.monotonic() - since, tries, pause,
            )  # fmt: skip
            time.sleep(pause)
            pause = min(most, pause * 2)

    def check_serves(self, *paths: str, rejoin: bool = False) -> None:
        """Refuse a server that serves another model than ``paths`` name, lacks the rlwire
        weight transfer, or holds weights an earlier run sent (``rejoin``: a server this
        run lost and takes back may hold this run's: the re-formed group's first update
        is whole)."""
        models = self._call("/v1/models", shape=_MODELS)["data"]
        served = {name for m in models for name in (m["id"], m.get("root")) if name}
        wanted = {p for p in paths if p}
        if not {str(Path(s).resolve()) for s in served} & {str(Path(p).resolve()) for p in wanted}:
            raise RuntimeError(
                f"vllm_server {self.url} serves {sorted(served)}, not the model this run trains "
                f"({', '.join(sorted(wanted))})"
            )
        self.model_name = models[0]["id"]
        try:
            answer = self._call("/collective_rpc", {"method": "rlwire_weight_versions"})
        except RuntimeError as err:
            raise RuntimeError(f"{err}; start the server with {SERVER_FLAGS}") from None
        (held,) = self._shaped("/collective_rpc", answer, _VERSIONS)["results"]
        if not held["rlwire"]:
            raise RuntimeError(
                f"vllm_server {self.url} has no rlwire weight transfer; start it with "
                f"{SERVER_FLAGS}"
            )
        if held["held"] is not None and not rejoin:
            raise RuntimeError(
                f"vllm_server {self.url} serves weights version {held['held']} that an earlier "
                "run sent, not the model's own: restart it"
            )

    def init_weight_transfer(
        self, backend: str, *, rank: int, world_size: int, metadata: dict, timeout: float
    ) -> None:
        # an update a lost worker left open (vLLM refuses to start another) ends first
        self._call("/collective_rpc", {"method": "rlwire_end_update"}, timeout=self.health_timeout)
        info = transfer_init_info(
            backend,
            rank=rank,
            world_size=world_size,
            metadata=metadata,
            timeout=timeout,
            token=self.token,
        )
        self._call("/init_weight_transfer_engine", {"init_info": info}, timeout=timeout + 30)
        self.update_timeout = _update_bound(timeout)

    def receive_update(self, *, poll: float = 5.0) -> int:
        """Receive one whole update beside the weights in use; its version.

        ``/update_weights`` answers once the whole update arrived, which takes longer in
        all the larger the model; the server's receiver bounds each of its waits by
        ``ckpt_engine.timeout`` (the init info's) and answers with that error. Meanwhile
        ``/health`` is asked every ``poll`` seconds: each answer is progress
        (:attr:`progressed_at`, what the staging caller's wait reads); a server that leaves
        it unanswered for :attr:`health_timeout` seconds is lost (:class:`~.base.EngineLost`).
        ``/health`` answers while a stuck update holds the server's workers, so the whole
        update is bounded too: a server that has not answered it within
        :attr:`update_timeout` seconds is lost (the call's own thread ends then as well).
        A model whose update takes longer needs a larger ``ckpt_engine.timeout``."""
        bound = self.update_timeout
        self._call("/start_weight_update", {}, timeout=self.health_timeout)
        outcome: list[BaseException | None] = []

        def update() -> None:
            try:
                self._call("/update_weights", {"update_info": {}}, timeout=bound)
                outcome.append(None)
            except BaseException as err:  # re-raised in the caller's thread
                outcome.append(err)

        call = threading.Thread(target=update, name="rlwire-vllm-update", daemon=True)
        began = self.progressed_at = time.monotonic()
        call.start()
        call.join(min(poll, bound))
        while call.is_alive():
            if time.monotonic() - began > bound:
                raise EngineLost(
                    f"vllm_server {self.url}: no answer to /update_weights within {bound:g} s "
                    "(the whole update's bound: twice ckpt_engine.timeout and 30 s; raise "
                    "ckpt_engine.timeout for a model whose update takes longer)",
                    self.index,
                )
            if self.healthy():
                self.progressed_at = time.monotonic()
            elif time.monotonic() - self.progressed_at > self.health_timeout:
                raise EngineLost(
                    f"vllm_server {self.url}: no answer to /health for "
                    f"{time.monotonic() - self.progressed_at:.0f} s while it received an update "
                    f"(rollout.vllm.health_timeout: {self.health_timeout:g} s)",
                    self.index,
                )
            call.join(min(poll, max(0.0, began + bound - time.monotonic())))
        if outcome[0] is not None:
            if "the update was aborted" in str(outcome[0]):  # the type is lost over HTTP
                from rlwire.ckpt_engine import CheckpointEngineAborted

                raise CheckpointEngineAborted(str(outcome[0])) from None
            raise outcome[0]
        (versions,) = self._call(
            "/collective_rpc",
            {"method": "rlwire_weight_versions"},
            timeout=self.health_timeout,
            shape=_VERSIONS,
        )["results"]
        if versions["staged"] is None:
            raise RuntimeError(
                f"vllm_server {self.url}: /update_weights answered, but the server holds no "
                "received update (rlwire_weight_versions: staged is null)"
            )
        return versions["staged"]

    def finish_update(self, version: int) -> None:
        """Write the received update in; the prefix cache (KV of the old weights) reset."""
        self._call("/finish_weight_update", {"weight_version": str(version)})
        self._call("/reset_prefix_cache", {}, timeout=self.health_timeout)

    def complete(self, body: dict, *, expected: int) -> list[tuple[list[int], list[float], str]]:
        """``/v1/completions``: each choice's sampled token ids, their log-probs and its
        finish reason, in choice order."""
        answer = self._call("/v1/completions", body, shape=_COMPLETIONS)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != expected:
            raise RuntimeError(
                f"vllm_server {self.url}: {len(choices)} completions for {expected} requested"
            )
        out = []
        for choice in choices:
            tokens, values = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            if len(values) != len(tokens):
                raise RuntimeError(
                    f"vllm_server {self.url}: {len(values)} log-probs for {len(tokens)} tokens"
                )
            out.append((tokens, values, choice["finish_reason"]))
        return out


def _update_bound(timeout: float) -> float:
    """Seconds a whole update may take where the checkpoint engine bounds each of its waits
    by ``timeout``: the budget the trainer gives a transfer without progress (two waits and
    30 s), since an update in a server shows none of its own over HTTP."""
    return 2 * timeout + 30


# --- the answers' shapes: what each caller reads, checked before it reads it ------------------


class _Shape(NamedTuple):
    """What a caller reads in an answer: ``holds`` says whether a parsed answer has it,
    ``text`` says what, in the error that refuses one without it."""

    holds: Callable[[Any], bool]
    text: str


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _list_of(value: Any, each: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(each(v) for v in value)


def _model(m: Any) -> bool:
    return (
        isinstance(m, dict)
        and isinstance(m.get("id"), str)
        and isinstance(m.get("root"), str | None)
    )


def _versions(answer: Any) -> bool:
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != 1 or not isinstance(results[0], dict):
        return False
    one = results[0]
    return (
        isinstance(one.get("rlwire"), bool)
        and (one.get("held") is None or _int(one.get("held")))
        and (one.get("staged") is None or _int(one.get("staged")))
    )


def _choice(c: Any) -> bool:
    logprobs = c.get("logprobs") if isinstance(c, dict) else None
    return (
        isinstance(logprobs, dict)
        and _int(c.get("index"))
        and _list_of(c.get("token_ids"), _int)
        and _list_of(logprobs.get("token_logprobs"), _number)
        and isinstance(c.get("finish_reason"), str)
    )


_MODELS = _Shape(
    lambda a: isinstance(a, dict) and _list_of(a.get("data"), _model),
    '{"data": [{"id": str, "root": str or null}, ...]}',
)
_VERSIONS = _Shape(
    _versions,
    '{"results": [{"rlwire": bool, "held": int or null, "staged": int or null}]} (one worker)',
)
_COMPLETIONS = _Shape(
    lambda a: isinstance(a, dict) and _list_of(a.get("choices"), _choice),
    '{"choices": [{"index": int, "token_ids": [int, ...], "logprobs": {"token_logprobs": '
    '[number, ...]}, "finish_reason": str}, ...]}',
)
