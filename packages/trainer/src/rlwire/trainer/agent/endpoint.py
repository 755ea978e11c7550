"""An OpenAI-compatible endpoint on a rollout engine: ``POST /v1/chat/completions`` and
``POST /v1/completions`` (and ``GET /v1/models``) in the OpenAI shapes, served with FastAPI
and uvicorn in a thread of the process that holds the engine, each call one request to the
engine (:meth:`~rlwire.trainer.rollout.RolloutEngine.submit`).

Every call belongs to a session (:mod:`.sessions`): its API key (``Authorization: Bearer``)
is the session's key; an unknown or ended one gets 401. The answers carry, beside the
OpenAI fields, the prompt's token ids (``prompt_token_ids``), the sampled ones
(``choices[0].token_ids``, as vLLM's ``return_token_ids``), their behaviour log-probs
(``logprobs``) and weight versions (``weight_versions``).

Token in, token out for chat: where a chat call's messages are the session's previous chat
call's messages, then the assistant message it answered (content and tool calls equal),
then new ones, its prompt is the previous call's prompt and sampled tokens, exactly, then
the template's rendering of the new messages (:meth:`.render.ChatRenderer.turn`); nothing
the model sampled is decoded and encoded again. Otherwise the messages are rendered whole.

Sampling is the run's: ``rollout.temperature`` whatever the call asks (the actor recomputes
the behaviour log-probs at it), at most ``max_tokens`` (or ``max_completion_tokens``) and
``rollout.max_new_tokens`` tokens, seeded per session and call. The server listens on
loopback unless told otherwise (``host``). A body is read only once its session's key is
known, at most ``max_body`` bytes of it (413 past that), and parsed by :mod:`.bodies`:
a call it refuses never reaches the engine.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations as
# objects (a string naming a class local to app() would not resolve).
import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import RunError
from ..rollout.requests import Request, request_seed
from .bodies import (
    MAX_BODY_BYTES,
    chat_call,
    check_length,
    check_prompt,
    completion_call,
    max_tokens,
    parse_json,
    too_large,
)
from .bodies import Refused as _Refused  # the name this module's callers and tests know
from .parsers import ToolCallParser
from .render import ChatRenderer
from .sessions import CallRecord, Session, SessionStore

__all__ = ["Endpoint", "INSTALL_HINT"]

INSTALL_HINT = (
    "the agent endpoint needs FastAPI and uvicorn (and agents the openai client): "
    "pip install 'rlwire-trainer[openai]'"
)


class Endpoint:
    """The endpoint of one engine.

    Args:
        submit: the engine's ``submit`` (a :class:`~rlwire.trainer.rollout.requests.Request`
            in, a future of its ``Completion`` out).
        tokenizer: the policy's (its chat template renders chat calls).
        parser: reads tool calls in a chat answer (``agent.format``).
        temperature, max_new_tokens: the run's sampling (``rollout.*``).
        timeout: seconds a call may wait for its completion (``rollout.request_timeout``).
        model: the name ``/v1/models`` gives and answers carry.
        context: the model's context in tokens, where the engine tells it: a prompt that
            leaves no room for one token is refused (400), and ``max_tokens`` is cut to fit.
        vocabulary: the model's vocabulary size (its embedding's rows), where the engine
            tells it: a prompt's token ids must lie below it and below the tokenizer's
            length (400 otherwise); a tokenizer may hold added tokens the model has no
            embedding for, and a model may pad its embedding past the tokenizer's ids.
        max_body: bytes a call's body may hold (:data:`.bodies.MAX_BODY_BYTES`); a longer
            one is refused (413) before it is read, with or without ``Content-Length``.
    """

    def __init__(
        self,
        submit: Callable[[Request], concurrent.futures.Future],
        tokenizer,
        parser: ToolCallParser,
        *,
        temperature: float,
        max_new_tokens: int,
        timeout: float,
        model: str = "rlwire-policy",
        top_p: float = 1.0,
        top_k: int = 0,
        context: int | None = None,
        vocabulary: int | None = None,
        max_body: int = MAX_BODY_BYTES,
    ) -> None:
        self.submit, self.tokenizer, self.parser = submit, tokenizer, parser
        self.context, self.max_body = context, max_body
        if vocabulary is not None and (
            isinstance(vocabulary, bool) or not isinstance(vocabulary, int) or vocabulary < 1
        ):
            raise ValueError(f"vocabulary: {vocabulary!r}; use the model's size, an int >= 1")
        self.vocabulary = len(tokenizer) if vocabulary is None else min(len(tokenizer), vocabulary)
        """Token ids a prompt may hold are those below this: the smaller of the tokenizer's
        length and the model's vocabulary."""
        self.temperature, self.max_new_tokens, self.timeout = temperature, max_new_tokens, timeout
        self.model, self.top_p, self.top_k = model, top_p, top_k
        self.sessions = SessionStore()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.url = ""

    # --- serving -----------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> str:
        """Serve in a thread of this process; the base URL (``http://host:port/v1``). A
        start that fails (the address taken, the server not up within ``timeout`` seconds)
        leaves nothing behind: the server thread is stopped and the socket closed."""
        try:
            import uvicorn
        except ImportError as err:
            raise RuntimeError(f"{INSTALL_HINT} ({err})") from None
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket = sock
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            config = uvicorn.Config(self.app(), log_level="warning", access_log=False)
            self._server = uvicorn.Server(config)
            self._thread = threading.Thread(
                target=self._server.run,
                kwargs={"sockets": [sock]},
                name="rlwire-endpoint",
                daemon=True,
            )
            self._thread.start()
            deadline = time.monotonic() + timeout
            while not self._server.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"agent endpoint: did not start on {host}:{port} in {timeout:g} s"
                    )
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}/v1"
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (waiting ``timeout`` seconds for the thread) and close the socket."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # its loop may still use the socket: left to it
                return
        if self._socket is not None:
            self._socket.close()  # the server closed it when it ran; not when it did not
        self._server = self._thread = self._socket = None

    def app(self):
        try:
            from fastapi import FastAPI
            from fastapi import Request as HTTPRequest
            from fastapi.responses import JSONResponse
        except ImportError as err:
            raise RuntimeError(f"{INSTALL_HINT} ({err})") from None

        app = FastAPI(title="rlwire agent endpoint", docs_url=None, redoc_url=None)

        async def answer(http: HTTPRequest, handle) -> JSONResponse:
            try:
                session = self._session(http.headers.get("authorization", ""))
                body = parse_json(await self._read(http))
                return JSONResponse(await handle(session, body))
            except _Refused as refused:
                error = {"message": refused.message, "type": "invalid_request_error"}
                # a body left unread (413) must not be taken for the next request
                close = {"Connection": "close"} if refused.status == 413 else None
                return JSONResponse({"error": error}, status_code=refused.status, headers=close)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(http: HTTPRequest) -> JSONResponse:
            return await answer(http, self._chat)

        @app.post("/v1/completions")
        async def completions(http: HTTPRequest) -> JSONResponse:
            return await answer(http, self._completion)

        return app

    # --- calls -------------------------------------------------------------------------
    async def _read(self, http) -> bytes:
        """The body, at most :attr:`max_body` bytes: refused (413) on its ``Content-Length``
        before it is read, or as it arrives where it has none (chunked)."""
        limit = self.max_body
        check_length(http.headers.get("content-length"), limit)
        raw = bytearray()
        async for chunk in http.stream():
            raw += chunk
            if len(raw) > limit:
                raise too_large(limit)
        return bytes(raw)

    def _session(self, authorization: str) -> Session:
        key = authorization.removeprefix("Bearer ").strip()
        session = self.sessions.get(key) if key else None
        if session is None:
            raise _Refused(401, "unknown or ended session: use the API key your session was given")
        return session

    async def _sample(self, session: Session, prompt: list[int], body: dict):
        room = check_prompt(prompt, vocabulary=self.vocabulary, context=self.context)
        asked = max_tokens(body)
        if asked is None:
            asked = self.max_new_tokens
        calls = len(session.calls)
        request = Request(
            tuple(prompt),
            min(asked, self.max_new_tokens, *([] if room is None else [room])),
            self.temperature,
            seed=request_seed(session.seed, calls),
            top_p=self.top_p,
            top_k=self.top_k,
        )
        future = asyncio.wrap_future(self.submit(request))
        try:
            return await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise _Refused(504, f"no completion within {self.timeout:g} s") from None

    def _record(self, session: Session, call: CallRecord) -> None:
        if not session.record(call):
            raise _Refused(401, "the session ended while the call ran; nothing was recorded")

    async def _chat(self, session: Session, body: dict) -> dict:
        call = chat_call(body)
        messages, tools = call.messages, call.tools
        try:
            prompt = self._chat_prompt(session, messages, tools)
        except RunError as err:  # no chat template, or one that rewrites earlier turns
            raise _Refused(400, str(err)) from None
        done = await self._sample(session, prompt, body)
        text = self.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        content, calls = self._tool_calls(text) if tools else (text, [])
        reply: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            reply["tool_calls"] = calls
        self._record(
            session,
            CallRecord(
                tuple(prompt), tuple(done.token_ids), tuple(done.logprobs), tuple(done.versions),
                messages=tuple(messages), reply=reply,
            ),
        )  # fmt: skip
        finish = "tool_calls" if calls else done.finish_reason
        return self._answer("chat.completion", prompt, done, finish, {"message": reply})

    def _chat_prompt(self, session: Session, messages: list[dict], tools: list[dict]) -> list[int]:
        """The session's previous chat call's tokens, then the new messages' (see the
        module's docstring); or the messages rendered whole."""
        renderer = ChatRenderer(self.tokenizer, tools or None)
        last = session.last_chat()
        if last is not None and last.messages is not None and last.reply is not None:
            seen = len(last.messages)
            ended = bool(last.token_ids) and last.token_ids[-1] == self.tokenizer.eos_token_id
            if (
                ended
                and len(messages) > seen + 1
                and [_plain(m) for m in messages[:seen]] == [_plain(m) for m in last.messages]
                and _plain(messages[seen]) == _plain(last.reply)
            ):
                new = [_plain(m) for m in messages[seen + 1 :]]
                return list(last.prompt_ids) + list(last.token_ids) + renderer.turn(new)
        text = self.tokenizer.apply_chat_template(
            [_plain(m) for m in messages], tools=tools or None, tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _tool_calls(self, text: str) -> tuple[str, list[dict]]:
        parsed = [c for c in self.parser.parse(text) if c.error is None]
        if not parsed:
            return text, []
        content = text[: text.find(parsed[0].text)].strip() if parsed[0].text in text else ""
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in parsed
        ]
        return content, calls

    async def _completion(self, session: Session, body: dict) -> dict:
        prompt = completion_call(body).prompt
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = list(prompt)
        done = await self._sample(session, ids, body)
        self._record(
            session,
            CallRecord(
                tuple(ids), tuple(done.token_ids), tuple(done.logprobs), tuple(done.versions)
            ),
        )
        text = self.tokenizer.decode(done.token_ids, skip_special_tokens=True)
        logprobs = {
            "tokens": self.tokenizer.convert_ids_to_tokens(done.token_ids),
            "token_logprobs": done.logprobs,
        }
        return self._answer(
            "text_completion", ids, done, done.finish_reason, {"text": text, "logprobs": logprobs}
        )

    def _answer(self, kind: str, prompt: list[int], done, finish: str, choice: dict) -> dict:
        if kind == "chat.completion":
            tokens = self.tokenizer.convert_ids_to_tokens(done.token_ids)
            choice["logprobs"] = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(tokens, done.logprobs, strict=True)
                ]
            }
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {"index": 0, "finish_reason": finish, "token_ids": list(done.token_ids), **choice}
            ],
            "prompt_token_ids": list(prompt),
            "weight_versions": list(done.versions),
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(done.token_ids),
                "total_tokens": len(prompt) + len(done.token_ids),
            },
        }


def _plain(message: dict) -> dict:
    """A message as the chat template takes it and as calls compare it: role, content
    (None as empty) and tool calls with their arguments as objects, nothing else."""
    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content") or ""}
    calls = message.get("tool_calls") or []
    if calls:
        plain = []
        for call in calls:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                with contextlib.suppress(json.JSONDecodeError):  # else kept as written
                    arguments = json.loads(arguments)
            plain.append(
                {
                    "type": "function",
                    "function": {"name": function.get("name"), "arguments": arguments},
                }
            )
        out["tool_calls"] = plain
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out
