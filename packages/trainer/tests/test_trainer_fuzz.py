"""The fuzzer over the trainer's parsers of bytes another process (or another machine)
wrote: a checkpoint's MANIFEST.json (of checkpoints with files drawn at random; left genuine,
rewritten with the same meaning, mutated, or its files damaged: it is either accepted, only
when the files match it, or refused with one RunError; it never reads outside the
checkpoint), and the agent endpoint's request bodies (below). Each of the two asserts that at
least :data:`MIN_ACCEPTED` of its inputs are accepted, so that the checks there run.

Each test runs a fixed, derandomized budget here; ``RLWIRE_FUZZ_EXAMPLES=100000`` runs a long
one by hand."""

from __future__ import annotations

import collections
import json
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rlwire.trainer.errors import RunError
from rlwire.trainer.outputs.checkpoint import check_manifest, write_manifest

EXAMPLES = int(os.environ.get("RLWIRE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 1000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


MIN_ACCEPTED = 0.2
"""The share of each parser's inputs that must be accepted: below it, the checks on what is
accepted hardly run."""
_tally: collections.Counter[str] = collections.Counter()


def _outcome(label: str) -> None:
    """Count an input as ``...: accepted`` or ``...: refused`` (its label in the statistics)."""
    event(label)
    _tally[label] += 1


def _share_accepted(fuzz, **fixtures) -> None:
    """Run one fuzz test and require :data:`MIN_ACCEPTED` of its inputs to be accepted."""
    _tally.clear()
    fuzz(**fixtures)
    accepted = sum(n for label, n in _tally.items() if label.endswith("accepted"))
    refused = sum(n for label, n in _tally.items() if label.endswith("refused"))
    total = accepted + refused
    print(f"{fuzz.__name__}: {accepted} accepted, {refused} refused of {total}: {dict(_tally)}")
    assert total and accepted >= MIN_ACCEPTED * total, dict(_tally)


_FILES = st.dictionaries(  # a checkpoint's files: nested, empty ones among them
    st.sampled_from(
        ["trainer_state.json", "actor/__0_0.distcp", "actor/__1_0.distcp", "a/b/c.bin", "x y"]
    ),
    st.binary(max_size=300),
    min_size=1,
    max_size=4,
)


@FUZZ
@given(data=st.data())
def _fuzz_manifest(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("step_4")
    files = data.draw(_FILES)
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    write_manifest(directory)
    genuine = (directory / "MANIFEST.json").read_bytes()
    entries = json.loads(genuine)
    kind = data.draw(st.sampled_from(["genuine", "reformatted", "bytes", "json", "file"]))
    mutated, must = genuine, kind in ("genuine", "reformatted")  # must be accepted
    if kind == "reformatted":  # the same mapping written another way
        keys = data.draw(st.permutations(sorted(entries)))
        mutated = json.dumps(
            {k: dict(reversed(entries[k].items())) for k in keys},
            indent=data.draw(st.sampled_from([None, 0, 4])),
            ensure_ascii=data.draw(st.booleans()),
        ).encode()
    elif kind == "bytes":
        raw = bytearray(genuine)
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        mutated = bytes(raw)
    elif kind == "json":
        value = data.draw(
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                lambda inner: (
                    st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3)
                ),
                max_leaves=8,
            )
        )
        name = data.draw(st.sampled_from([*entries, "../outside", "/etc/hostname", "x"]))
        field = data.draw(st.sampled_from(["bytes", "sha256", None]))
        changed = dict(entries)
        changed[name] = value if field is None else {**entries.get(name, {}), field: value}
        mutated = json.dumps(changed).encode()
    elif kind == "file":  # a file damaged after the manifest was written: refused
        name = data.draw(st.sampled_from(sorted(files)))
        content = data.draw(st.binary(max_size=300))
        (directory / name).write_bytes(content)
        must = content == files[name]  # the same bytes rewritten: still true
    (directory / "MANIFEST.json").write_bytes(mutated)
    try:
        check_manifest(directory, missing="require")
    except RunError:
        assert must is not True, (kind, mutated)
        _outcome(f"manifest, {kind}: refused")
        return
    assert must is not False, (kind, mutated)
    _outcome(f"manifest, {kind}: accepted")
    assert json.loads(mutated) == entries  # accepted: it says what the files are


def test_a_mutated_manifest_is_accepted_only_when_true_or_refused(tmp_path_factory):
    _share_accepted(_fuzz_manifest, tmp_path_factory=tmp_path_factory)


# --- the agent endpoint's request bodies ---------------------------------------------------
# What an agent sends (``/v1/chat/completions``, ``/v1/completions`` with text or token ids),
# mutated at random as bytes or as JSON: each body is accepted and read as it says, or refused
# with the endpoint's one error (:class:`~rlwire.trainer.agent.bodies.Refused`, 400); what is
# accepted is then taken by the next step (:func:`~rlwire.trainer.agent.endpoint._plain`, the
# token-id checks) without an error of another kind.

VOCABULARY, CONTEXT = 100, 32
_BODIES = {
    "chat": {
        "model": "rlwire-policy",
        "messages": [
            {"role": "system", "content": "answer briefly"},
            {"role": "user", "content": "look up abc"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"key": "abc"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "123"},
            {"role": "user", "content": [{"type": "text", "text": "and d?"}], "name": "u"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
                },
            }
        ],
        "max_tokens": 16,
        "temperature": 0.7,
    },
    "ids": {"model": "rlwire-policy", "prompt": [5, 6, 7, 8, 99], "max_completion_tokens": 4},
    "text": {
        "model": "rlwire-policy",
        "prompt": "ab:",
        "max_tokens": 8,
        "max_completion_tokens": None,
    },
}
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(value, at=()):
    """Every place in a JSON value: its path of keys and indices."""
    yield at
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, inner in items:
        yield from _paths(inner, (*at, key))


def _mutated_body(body: dict, draw) -> bytes:
    """``body`` changed as JSON (a value replaced or removed, wrapped deep) or as bytes
    (flipped, cut, repeated, a number replaced, nested past the parser's stack)."""
    kind = draw(
        st.sampled_from(["replace", "remove", "deep", "flip", "cut", "repeat", "number", "nest"])
    )
    if kind in ("replace", "remove", "deep"):
        changed = json.loads(json.dumps(body))
        path = draw(st.sampled_from(list(_paths(changed))[1:]))
        holder = changed
        for key in path[:-1]:
            holder = holder[key]
        if kind == "remove":
            del holder[path[-1]]
        elif kind == "deep":
            value = holder[path[-1]]
            for _ in range(draw(st.integers(1, 100))):
                value = [value]
            holder[path[-1]] = value
        else:
            holder[path[-1]] = draw(_JSON)
        return json.dumps(changed).encode()
    raw = bytearray(json.dumps(body).encode())
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    elif kind == "cut":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + raw[at + draw(st.integers(1, 64)) :]
    elif kind == "repeat":
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + raw[at : at + draw(st.integers(1, 64))] * 2 + raw[at:]
    elif kind == "number":
        digits = [i for i, c in enumerate(raw) if chr(c).isdigit()]
        at = draw(st.sampled_from(digits))
        number = draw(st.one_of(st.integers(-(2**70), 2**70), st.floats().map(repr)))
        raw = raw[:at] + str(number).encode() + raw[at + 1 :]
    else:
        depth = draw(st.sampled_from([2, 63, 64, 65, 5000, 100_000]))
        raw = b'{"x": ' + b"[" * depth + bytes(raw) + b"]" * depth + b"}"
    return bytes(raw)


def _valid_body(body: dict, draw) -> bytes:
    """``body`` with its numbers and token ids drawn anew, within what the endpoint takes."""
    changed = json.loads(json.dumps(body))
    asked = draw(st.integers(1, 2**31))
    changed["max_completion_tokens" if "max_completion_tokens" in changed else "max_tokens"] = asked
    if isinstance(changed.get("prompt"), list):
        changed["prompt"] = draw(st.lists(st.integers(0, VOCABULARY - 1), min_size=1, max_size=8))
    return json.dumps(changed, indent=draw(st.sampled_from([None, 1]))).encode()


@FUZZ
@given(st.data(), st.sampled_from(sorted(_BODIES)))
def _fuzz_endpoint_bodies(data, which):
    from rlwire.trainer.agent.bodies import (
        MAX_DEPTH,
        Refused,
        chat_call,
        check_prompt,
        completion_call,
        parse_json,
    )
    from rlwire.trainer.agent.endpoint import _plain

    genuine = data.draw(st.integers(0, 2)) == 0  # a third valid, the rest mutated
    raw = (_valid_body if genuine else _mutated_body)(_BODIES[which], data.draw)
    try:
        body = parse_json(raw)
        call = chat_call(body) if which == "chat" else completion_call(body)
        if isinstance(getattr(call, "prompt", None), list):
            room = check_prompt(call.prompt, vocabulary=VOCABULARY, context=CONTEXT)
            assert room is not None and room >= 1 and len(call.prompt) + room == CONTEXT
            assert all(not isinstance(t, bool) and 0 <= t < VOCABULARY for t in call.prompt)
    except Refused as refused:
        assert refused.status == 400 and refused.message  # a 400 naming what is wrong
        assert not genuine, (raw, refused.message)
        _outcome(f"{which}: refused")
        return
    _outcome(f"{which}, {'valid' if genuine else 'mutated'}: accepted")
    assert _depth(body) <= MAX_DEPTH
    asked = body.get("max_completion_tokens")
    asked = body.get("max_tokens") if asked is None else asked
    assert call.max_tokens == asked and (asked is None or (type(asked) is int and asked >= 1))
    if which == "chat":
        assert call.messages is body["messages"]  # read as it says
        tools = body.get("tools") or []
        assert call.tools == [t.get("function", t) for t in tools]
        assert all(isinstance(t["name"], str) for t in call.tools)
        for message in call.messages:  # the next step takes them as they are
            plain = _plain(message)
            assert isinstance(plain["role"], str) and plain["role"]
            json.dumps(plain)
    else:
        assert call.prompt is body["prompt"]
        assert isinstance(call.prompt, str) or all(type(t) is int for t in call.prompt)


def test_a_mutated_endpoint_body_is_read_as_it_says_or_refused():
    _share_accepted(_fuzz_endpoint_bodies)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@FUZZ
@given(st.one_of(st.integers(-5, 2**70).map(str), st.text(max_size=12), st.none()))
def test_a_content_length_is_taken_within_the_limit_or_refused(declared):
    from rlwire.trainer.agent.bodies import Refused, check_length

    try:
        check_length(declared, 1000)
    except Refused as refused:
        assert refused.status in (400, 413)
        assert refused.status == 400 or int(declared) > 1000
        return
    assert declared is None or 0 <= int(declared) <= 1000
