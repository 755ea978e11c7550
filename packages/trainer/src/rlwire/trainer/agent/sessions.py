"""Sessions of an agent that calls the policy through the endpoint (:mod:`.endpoint`): what
each call sent and got, as token ids, and how a session's calls become training samples.

A session is one conversation of an agent (one data row, one sample of its group): it has a
key of its own, unguessable, which its client sends as its API key; the endpoint records
every call made with it (:class:`CallRecord`: the prompt's token ids, the sampled token
ids, their behaviour log-probs and weight versions) and refuses calls once it has ended.

**Merging** (:func:`merge_calls`): where a call's prompt extends the previous call's prompt
and completion token for token, the two are one sequence: the tokens between (the tool
results, the template's) are appended with loss mask 0, then the new completion with mask 1.
Where it does not (the agent rewrote or cut its history), the sequence so far is closed and
the call starts a new one; the samples of a session share its reward (and so its advantage).
:attr:`SessionSamples.breaks` counts those. No token is ever re-encoded from text here: the
ids trained on are the ids the endpoint returned.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from typing import Any

__all__ = ["CallRecord", "Session", "SessionSamples", "SessionStore", "TokenSample", "merge_calls"]


@dataclasses.dataclass(frozen=True, slots=True)
class CallRecord:
    """One call of a session: the token ids the engine was given and what it sampled.
    ``messages`` and ``reply``: a chat call's messages and the assistant message it
    returned (the next call's messages that start with both reuse these tokens)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    messages: tuple[dict[str, Any], ...] | None = None
    reply: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"CallRecord: {len(self.token_ids)} tokens, {len(self.logprobs)} log-probs and "
                f"{len(self.versions)} versions; one each per token"
            )


@dataclasses.dataclass(slots=True)
class TokenSample:
    """One training sequence: the prompt's ids, then the response's (the sampled tokens with
    mask 1 and their behaviour log-probs and versions; tokens between calls with mask 0,
    log-prob 0 and the version of the model token before them)."""

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)

    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extend(self, ids: list[int], call: CallRecord) -> None:
        """``ids`` (mask 0) then ``call``'s completion (mask 1)."""
        before = self.versions[-1] if self.versions else (call.versions or (0,))[0]
        self.response_ids += ids + list(call.token_ids)
        self.mask += [0] * len(ids) + [1] * len(call.token_ids)
        self.logprobs += [0.0] * len(ids) + list(call.logprobs)
        self.versions += [before] * len(ids) + list(call.versions)


@dataclasses.dataclass(slots=True)
class SessionSamples:
    """A session's training samples, in call order, and how many times a call did not
    extend the sequence before it (``breaks``: samples - 1, for a session with calls)."""

    samples: list[TokenSample]
    breaks: int


def merge_calls(calls: list[CallRecord]) -> SessionSamples:
    """A session's calls as training sequences (see the module's docstring)."""
    samples: list[TokenSample] = []
    for call in calls:
        prompt = list(call.prompt_ids)
        last = samples[-1] if samples else None
        if last is not None:
            context = last.context()
            if prompt[: len(context)] == context:
                last.extend(prompt[len(context) :], call)
                continue
        sample = TokenSample(prompt)
        sample.extend([], call)
        samples.append(sample)
    return SessionSamples(samples, max(0, len(samples) - 1))


class Session:
    """One conversation's calls (thread-safe: the endpoint's threads record, the runner
    reads once it has ended); ``seed`` seeds its calls' sampling."""

    def __init__(self, key: str, seed: int) -> None:
        self.key, self.seed = key, seed
        self.calls: list[CallRecord] = []
        self.ended = False
        self._lock = threading.Lock()

    def record(self, call: CallRecord) -> bool:
        """Keep ``call``; False (and nothing kept) once the session has ended."""
        with self._lock:
            if self.ended:
                return False
            self.calls.append(call)
            return True

    def end(self) -> list[CallRecord]:
        """End the session (later calls are refused); its calls."""
        with self._lock:
            self.ended = True
            return list(self.calls)

    def last_chat(self) -> CallRecord | None:
        with self._lock:
            chats = [c for c in self.calls if c.messages is not None]
            return chats[-1] if chats else None


class SessionStore:
    """The run's open sessions by key: a key is 32 random bytes (URL-safe), unknown or ended
    keys are refused."""

    def __init__(self) -> None:
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, seed: int) -> Session:
        session = Session(f"rlwire-session-{secrets.token_urlsafe(32)}", seed)
        with self._lock:
            self._open[session.key] = session
        return session

    def get(self, key: str) -> Session | None:
        """The open session of ``key``, or None (unknown, or ended)."""
        with self._lock:
            session = self._open.get(key)
        return None if session is None or session.ended else session

    def close(self, session: Session) -> list[CallRecord]:
        """End ``session`` and forget its key; its calls."""
        calls = session.end()
        with self._lock:
            self._open.pop(session.key, None)
        return calls

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
