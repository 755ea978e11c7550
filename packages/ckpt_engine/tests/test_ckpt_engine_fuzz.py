"""A fuzzer over every parser of another process's bytes in this library: bucket metadata and
its chunks, delta payloads (gap forms, bitmask, escapes, zstd) and signed store messages.
Valid inputs are mutated at random (bytes flipped, cut, repeated, numbers replaced); every
input is either accepted (and then unpacks or decodes to what it says) or refused with
:class:`CheckpointEngineError`, and nothing allocates past the bytes that arrived.

Each test runs a fixed, derandomized budget here; ``RLWIRE_FUZZ_EXAMPLES=100000`` runs a long
one by hand."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from rlwire.ckpt_engine import CheckpointEngineError
from rlwire.ckpt_engine._wire import BucketMeta, Entry, Unpacker

EXAMPLES = int(os.environ.get("RLWIRE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 1000,  # the CI budget: the same inputs every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BUCKET = 2048
"""The receiver's bucket: a chunk's bytes come from it, never more."""


def _valid_metadata() -> bytes:
    """A bucket with a whole tensor, a chunk of a split one, a delta and an empty tensor."""
    return BucketMeta(
        3,
        7,
        1024,
        False,
        [
            Entry("a", "float32", (4, 8), 0, 0, 128),
            Entry("b", "bfloat16", (600,), 256, 0, 512),
            Entry("c", "float32", (64,), 768, 0, 40, None, ("gaps1", 3, 40)),
            Entry("d", "int64", (0,), 0, 0, 0),
        ],
        checksum=12345,
        base=6,
    ).to_bytes()


def _mutate(data: bytes, draw) -> bytes:
    """One of: bytes overwritten, a slice cut, a slice repeated, a number in the JSON text
    replaced by another (negative, huge, a float)."""
    kind = draw(st.sampled_from(["flip", "cut", "repeat", "number"]))
    raw = bytearray(data)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    elif kind == "cut":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + raw[at + draw(st.integers(1, 64)) :]
    elif kind == "repeat":
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + raw[at : at + draw(st.integers(1, 64))] * 2 + raw[at:]
    else:
        text = raw.decode(errors="replace")
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        at = draw(st.sampled_from(digits))
        number = draw(
            st.one_of(
                st.integers(-(2**70), 2**70),
                st.floats(allow_nan=False, allow_infinity=False).map(repr),
            )
        )
        raw = (text[:at] + str(number) + text[at + 1 :]).encode()
    return bytes(raw)


@FUZZ
@given(st.data())
def test_bucket_metadata_is_accepted_and_unpacked_or_refused(data):
    raw = _mutate(_valid_metadata(), data.draw)
    try:
        meta = BucketMeta.from_bytes(raw)
    except CheckpointEngineError:
        event("refused: metadata")
        return
    buf = torch.zeros(BUCKET, dtype=torch.uint8)
    unpacker = Unpacker()
    try:
        for name, value, _ in unpacker.unpack(meta, buf, copy=True, verify=False):
            entry = next(e for e in meta.entries if e.name == name)
            if isinstance(value, torch.Tensor):  # what it said: its shape and dtype
                assert tuple(value.shape) == entry.shape, name
    except CheckpointEngineError:
        event("refused: unpacking")
        return
    event("accepted")
    held = sum(sum(p.numel() for p in parts) for parts, _ in unpacker._partial.values())
    target(float(held), label="bytes held for split tensors")  # the largest: in the statistics
    assert held <= BUCKET  # only bytes that arrived are held, whatever the sizes claimed


def _delta_case() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(3000).to(torch.bfloat16)
    new = base.clone()
    new[torch.randperm(3000)[:40]] += 1  # gaps of every width, escapes included
    new[2000:2100] += 2
    return base, new


@FUZZ
@given(st.data(), st.sampled_from([None, "zstd"]))
def test_delta_payloads_decode_exactly_or_are_refused(data, compress):
    from rlwire.ckpt_engine._delta import decode, encode

    if compress == "zstd":
        pytest.importorskip("zstandard")
    base, new = _delta_case()
    fmt, changed, payload = encode(new, base.clone(), compress=compress or "off")
    assert fmt is not None
    mutated = data.draw(st.booleans())
    raw = bytes(payload.numpy().tobytes())
    if mutated:
        raw = _mutate(raw, data.draw) if raw else raw
        changed = data.draw(st.sampled_from([changed, changed + 1, max(changed - 1, 0), 0]))
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else payload[:0]
    try:
        delta = decode(fmt, changed, (3000,), torch.bfloat16, tensor)
    except CheckpointEngineError:
        event("refused")
        return
    event("accepted, mutated" if mutated else "accepted, genuine")
    out = delta.apply_(base.clone())
    if not mutated:
        assert torch.equal(out, new)  # the valid payload: bit-exact
    assert out.shape == base.shape  # a mutated one accepted stays within the tensor


@FUZZ
@given(st.data())
def test_signed_store_messages_verify_or_are_refused(data):
    from rlwire.ckpt_engine._store import SignedStore

    store = SignedStore(None, b"k" * 32, "gloo")  # type: ignore[arg-type]  # no TCP store: sign, verify
    value = json.dumps({"version": 3, "rank": 0}).encode()
    signed = store.sign("meta/0", value)
    assert store.verify("meta/0", signed) == value
    forged = _mutate(signed, data.draw)
    key = data.draw(st.sampled_from(["meta/0", "meta/1"]))
    try:
        got = store.verify(key, forged)
    except CheckpointEngineError:
        event("refused")
        return
    event("accepted")
    assert (key, got) == ("meta/0", value) and forged == signed  # only the genuine one passes
