"""A fuzzer over every parser of another process's bytes in this library: bucket metadata and
its chunks, delta payloads (gap forms, bitmask, escapes, zstd) and signed store messages.

The inputs are built valid, then some are changed: real tensors of every wire dtype
(:data:`~rlwire.ckpt_engine._dtypes.WIRE_DTYPES`), shapes with zero dimensions, split over
buckets, sent dense or as every delta form by the library's own packer
(:class:`~rlwire.ckpt_engine._bucketed.BucketedEngine`), with a fraction left genuine and the
rest changed as structure (a dtype outside the allow-list, a huge or reshaped dimension) or as
bytes (flipped, cut, repeated, a number replaced). Every input is either accepted (a genuine
one round-trips bit for bit; any accepted one unpacks or decodes to what its metadata says)
or refused with :class:`CheckpointEngineError`; any other exception fails. Each test asserts
that at least :data:`MIN_ACCEPTED` of its inputs reach the accepted branch, so that the
checks there run.

Each test runs a fixed, derandomized budget here; ``RLWIRE_FUZZ_EXAMPLES=100000`` runs a long
one by hand."""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rlwire.ckpt_engine import CheckpointEngineError
from rlwire.ckpt_engine._bucketed import BucketedEngine
from rlwire.ckpt_engine._delta import Delta
from rlwire.ckpt_engine._dtypes import WIRE_DTYPES
from rlwire.ckpt_engine._wire import BucketMeta, Unpacker, as_bytes, to_bytes

EXAMPLES = int(os.environ.get("RLWIRE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 1000,  # the CI budget: the same inputs every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MIN_ACCEPTED = 0.2
"""The share of each parser's inputs that must be accepted: below it, the checks on what is
accepted hardly run."""
OUTSIDE = ("complex64", "complex128", "qint8", "quint4x2", "bits8", "float8_e4m3fnuz", "float")
"""Dtype names the wire refuses (complex, quantized, bit types; a name torch lacks)."""
HUGE = ([2**40], [2**31, 2**31], [2**63 - 1], [2**63], [0, 2**62, 2**62], [-1], [True])
"""Shapes a peer may claim: valid but far past the bytes sent, too large, or not a shape."""
HAS_ZSTD = True
try:
    import zstandard  # noqa: F401  # only whether it is there: zstd deltas need it
except ImportError:
    HAS_ZSTD = False

_tally: collections.Counter[str] = collections.Counter()
_largest: collections.Counter[str] = collections.Counter()


def _outcome(label: str) -> None:
    """Count an input as ``accepted...`` or ``refused...`` (its label in the statistics too)."""
    event(label)
    _tally[label] += 1


def _share_accepted(fuzz: Callable[[], None]) -> None:
    """Run one fuzz test and require :data:`MIN_ACCEPTED` of its inputs to be accepted."""
    _tally.clear()
    _largest.clear()
    fuzz()
    accepted = sum(n for label, n in _tally.items() if label.startswith("accepted"))
    refused = sum(n for label, n in _tally.items() if label.startswith("refused"))
    total = accepted + refused
    print(f"{fuzz.__name__}: {accepted} accepted, {refused} refused of {total}: {dict(_tally)}")
    if _largest:
        print(f"largest: {dict(_largest)}")
    assert total and accepted >= MIN_ACCEPTED * total, dict(_tally)


def _mutate(data: bytes, draw) -> bytes:
    """One of: bytes overwritten, a slice cut, a slice repeated, a number in the JSON text
    replaced by another (negative, huge, a float)."""
    kind = draw(st.sampled_from(["flip", "cut", "repeat", "number"]))
    raw = bytearray(data)
    if not raw:
        return bytes([draw(st.integers(0, 255))])
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
        digits = [i for i, c in enumerate(text) if c.isdigit()] or [0]
        at = draw(st.sampled_from(digits))
        number = draw(
            st.one_of(
                st.integers(-(2**70), 2**70),
                st.floats(allow_nan=False, allow_infinity=False).map(repr),
            )
        )
        raw = (text[:at] + str(number) + text[at + 1 :]).encode()
    return bytes(raw)


# --- tensors built valid -------------------------------------------------------------------
SHAPES = st.one_of(
    st.just(()),  # a scalar
    st.lists(st.integers(0, 3), min_size=1, max_size=3),  # zero dimensions among small ones
    st.lists(st.integers(1, 40), min_size=1, max_size=2),
    st.sampled_from([[700], [3, 700], [20000]]),  # split over buckets; 2-byte gaps
    st.integers(64, 30000).map(lambda n: [n]),
).map(tuple)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes of ``dtype`` (NaNs and every float8 pattern included; bool 0 or 1); an odd
    ``seed`` gives bytes of 0 or 1 only, which zstd compresses."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    high = 2 if dtype == torch.bool or seed % 2 else 256
    raw = torch.randint(0, high, (numel * dtype.itemsize,), generator=g)
    return raw.to(torch.uint8).view(dtype).view(shape)


PATTERNS = ("none", "few", "spread", "many", "most")
"""Changes that make each delta form: none (an empty payload), a few (1-byte gaps), a few
far apart (2-byte gaps with escapes), many (a bitmask), most (sent whole)."""


def _changed(base: torch.Tensor, pattern: str, seed: int) -> torch.Tensor:
    """``base`` with the elements of ``pattern`` changed (a bit of each flipped)."""
    new = base.clone()
    n = new.numel()
    if n == 0 or pattern == "none":
        return new
    g = torch.Generator().manual_seed(seed)
    if pattern == "few":
        at = torch.randperm(n, generator=g)[: max(1, n // 50)]
    elif pattern == "spread":
        step = int(torch.randint(256, 1024, (1,), generator=g))  # past a 1-byte gap
        at = torch.arange(int(torch.randint(0, n, (1,), generator=g)), n, step)
    elif pattern == "many":
        at = torch.randperm(n, generator=g)[: max(1, n * 3 // 10)]
    else:
        at = torch.randperm(n, generator=g)[: max(1, n * 8 // 10)]
    rows = as_bytes(new).view(-1, base.element_size())
    rows[at.clamp(max=n - 1), 0] ^= 1  # bool stays 0 or 1
    return new


def _equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads included), with the same shape and dtype."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def _check_within(delta: Delta, changed: int) -> None:
    """``changed`` changes, at sorted positions inside the delta's tensor (nothing allocated
    from its shape: a peer may claim any)."""
    positions, n = delta.positions, 1
    for size in delta.shape:
        n *= size
    assert positions.numel() == delta.values.numel() == changed  # what the metadata says
    assert positions.numel() == 0 or (
        int(positions[0]) >= 0 and int(positions[-1]) < n and bool((positions.diff() > 0).all())
    )


# --- bucket metadata and its chunks --------------------------------------------------------
class _Recorder(BucketedEngine):
    """The library's packer with no transport: every bucket it emits is recorded as the bytes
    a receiver would get (its metadata and its used bytes)."""

    name = "fuzz_recorder"
    supports_delta = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(is_master=True, **kwargs)
        self.slots = [torch.zeros(self.bucket_size, dtype=torch.uint8) for _ in range(2)]
        self.sent: list[tuple[bytes, bytes]] = []
        self.held: int | None = None  # what the receiver says it holds

    def prepare(self) -> dict[str, Any]:
        return {}

    def _join(self, rank: int, world_size: int, master_metadata: dict[str, Any]) -> None:
        pass  # no transport: no group to join

    async def _exchange_held(self, held: int | None) -> list[int | None]:
        return [self.held]

    async def _acquire(self, slot: int, seq: int) -> None:
        pass  # no receiver holds a slot: each is free at once

    async def _emit(self, slot: int, meta: BucketMeta) -> None:
        self.sent.append((meta.to_bytes(), to_bytes(self.slots[slot][: meta.nbytes])))

    async def _drain(self, last_seq: int) -> None:
        pass  # every bucket was recorded as it was emitted: nothing in flight

    async def _next(self, seq: int) -> tuple[BucketMeta, torch.Tensor]:
        # a master only: the fuzz test parses the recorded buckets itself, no receive runs
        raise NotImplementedError("the recorder sends only")

    async def _release(self, meta: BucketMeta) -> None:
        pass  # no receiver side to release


@st.composite
def _updates(draw) -> dict[str, Any]:
    """An update as the packer sends it: 1-4 tensors of any wire dtype and shape, dense or a
    delta (every form, zstd or not) against the version the receiver holds."""
    delta = draw(st.booleans())
    compress = draw(st.sampled_from(["off", "zstd"])) if delta and HAS_ZSTD else "off"
    checksum = draw(st.booleans())
    base, new = {}, {}
    for i in range(draw(st.integers(1, 4))):
        dtype = WIRE_DTYPES[draw(st.sampled_from(sorted(WIRE_DTYPES)))]
        shape = draw(SHAPES)
        seed = draw(st.integers(0, 2**31))
        base[f"t{i}"] = _tensor(shape, dtype, seed)
        new[f"t{i}"] = _changed(base[f"t{i}"], draw(st.sampled_from(PATTERNS)), seed + 1)
    total = sum(t.numel() * t.element_size() for t in new.values())
    # at most about 40 buckets: a tensor of 240 KB in 256-byte buckets is slow, not more
    bucket = max(draw(st.sampled_from([256, 1024, 4096, 65536])), -(-total // 40 // 256) * 256)
    engine = _Recorder(
        bucket_size=bucket, checksum=checksum, delta="on" if delta else "off", compress=compress
    )
    engine.init_process_group(rank=0, world_size=2, master_metadata={})
    if delta:  # the first update (dense) fills the mirror; the second is the delta
        asyncio.run(engine.send_weights(base.items(), version=1))
        engine.sent.clear()
        engine.held = 1
    asyncio.run(engine.send_weights(new.items(), version=2))
    return _Update(bucket, checksum, compress if delta else None, base, new, engine.sent)


class _Update(dict):
    """An update's buckets and tensors, shown in a failure's report by dtype and shape."""

    def __init__(self, bucket, checksum, delta, base, new, sent) -> None:
        super().__init__(bucket=bucket, checksum=checksum, base=base, new=new, sent=sent)
        self.delta = delta

    def __repr__(self) -> str:
        tensors = {n: (str(t.dtype), tuple(t.shape)) for n, t in self["new"].items()}
        return (
            f"update(bucket={self['bucket']}, checksum={self['checksum']}, "
            f"delta={self.delta}, {len(self['sent'])} buckets, {tensors})"
        )


def _structural(raw: bytes, draw) -> tuple[bytes, bool]:
    """The metadata with one entry's dtype or shape replaced; and whether it must be refused
    (a dtype outside the allow-list)."""
    head = json.loads(raw)
    rows = head[5]
    if not rows:
        return raw, False
    row = rows[draw(st.integers(0, len(rows) - 1))]
    kind = draw(st.sampled_from(["dtype", "outside", "huge", "reshape"]))
    if kind == "dtype":  # another allowed dtype: read as that one, or refused by its size
        row[1] = draw(st.sampled_from(sorted(WIRE_DTYPES)))
    elif kind == "outside":
        row[1] = draw(st.sampled_from(OUTSIDE))
    elif kind == "huge":
        row[2] = draw(st.sampled_from(HUGE))
    else:  # the same elements in another shape: read as that shape
        numel = 1
        for size in row[2]:
            numel *= size
        row[2] = draw(st.sampled_from([[numel], [1, numel], [numel, 1], []]))
    return json.dumps(head, separators=(",", ":")).encode(), kind == "outside"


@FUZZ
@given(st.data())
def _fuzz_bucket_metadata(data):
    kind = data.draw(
        st.sampled_from(["genuine", "genuine", "structure", "structure", "bytes", "bytes", "data"])
    )
    update = data.draw(_updates())
    buckets = update["sent"]
    which = data.draw(st.integers(0, len(buckets) - 1))
    must_refuse = False
    meta_raw, buf_raw = buckets[which]
    if kind == "structure":
        meta_raw, must_refuse = _structural(meta_raw, data.draw)
    elif kind == "bytes":
        meta_raw = _mutate(meta_raw, data.draw)
    elif kind == "data":
        changed = _mutate(buf_raw, data.draw)[: len(buf_raw)]
        changed += bytes(len(buf_raw) - len(changed))  # the slot's bytes past a cut: zeros
        must_refuse = update["checksum"] and changed != buf_raw  # a CRC-32 catches it
        kind = "data" if changed != buf_raw else "genuine"  # an empty bucket, the same byte
        buf_raw = changed
    buckets = [*buckets[:which], (meta_raw, buf_raw), *buckets[which + 1 :]]
    received: dict[str, torch.Tensor | Delta] = {}
    unpacker, held, arrived = Unpacker(), 0, 0
    try:
        for meta_bytes, buf_bytes in buckets:
            meta = BucketMeta.from_bytes(meta_bytes)
            buf = torch.zeros(update["bucket"], dtype=torch.uint8)  # the receiver's slot
            if buf_bytes:
                buf[: len(buf_bytes)] = torch.frombuffer(bytearray(buf_bytes), dtype=torch.uint8)
            arrived += len(buf_bytes)
            for name, value, _ in unpacker.unpack(meta, buf, copy=True, verify=True):
                entry = next(e for e in meta.entries if e.name == name)
                dtype = WIRE_DTYPES[entry.dtype]
                if isinstance(value, torch.Tensor):  # what it said: its shape and dtype
                    assert (tuple(value.shape), value.dtype) == (entry.shape, dtype), name
                else:  # a delta's changes lie within a tensor of what it said
                    assert (value.shape, value.dtype) == (entry.shape, dtype), name
                    assert entry.delta is not None
                    _check_within(value, entry.delta[1])
                received[name] = value
            now = sum(sum(p.numel() for p in ps) for ps, _ in unpacker._partial.values())
            assert now <= arrived  # only bytes that arrived are held, whatever the sizes claimed
            held = max(held, now)
        unpacker.check_complete()
    except CheckpointEngineError:
        _outcome(f"refused, {kind}")
        return
    assert not must_refuse, (kind, meta_raw)
    _outcome(f"accepted, {kind}")
    _largest["bytes held for split tensors"] = max(_largest["bytes held for split tensors"], held)
    if kind != "genuine":
        return
    for meta_bytes, _ in buckets:  # which forms the accepted checks covered
        for e in BucketMeta.from_bytes(meta_bytes).entries:
            form = e.delta[0] if e.delta else "whole"
            event(f"sent as {form}")
            _tally[f"sent as {form}"] += 1
    assert list(received) == list(update["new"])  # every tensor, in sending order
    for name, tensor in update["new"].items():  # the round trip: bit for bit
        value = received[name]
        if isinstance(value, Delta):
            value = value.apply_(update["base"][name].clone())
        assert _equal_bytes(value, tensor), name


def test_bucket_metadata_is_accepted_and_unpacked_or_refused():
    _share_accepted(_fuzz_bucket_metadata)


# --- delta payloads ------------------------------------------------------------------------
@FUZZ
@given(st.data())
def _fuzz_delta_payloads(data):
    from rlwire.ckpt_engine._delta import decode, encode

    compress = data.draw(st.sampled_from(["off", "zstd"] if HAS_ZSTD else ["off"]))
    dtype = WIRE_DTYPES[data.draw(st.sampled_from(sorted(WIRE_DTYPES)))]
    shape = data.draw(SHAPES)
    seed = data.draw(st.integers(0, 2**31))
    base = _tensor(shape, dtype, seed)
    new = _changed(base, data.draw(st.sampled_from(PATTERNS[:4])), seed + 1)
    fmt, changed, payload = encode(new, base.clone(), compress=compress)
    if fmt is None:  # whole is no larger (a tiny or empty tensor): what an unchanged one sends
        fmt, changed, payload = "gaps1", 0, payload.new_empty(0, dtype=torch.uint8)
        new = base
    kind = data.draw(st.sampled_from(["genuine", "genuine", "structure", "bytes", "count"]))
    raw, name, must_refuse = to_bytes(payload), dtype, False
    if kind == "bytes":
        raw = _mutate(raw, data.draw)
    elif kind == "count":
        changed = data.draw(st.sampled_from([changed + 1, max(changed - 1, 0), 0, 2**63]))
    elif kind == "structure":
        choice = data.draw(st.sampled_from(["outside", "dtype", "huge", "format"]))
        if choice == "outside":
            name = getattr(torch, data.draw(st.sampled_from(OUTSIDE[:2])))
            must_refuse = True
        elif choice == "dtype":
            name = WIRE_DTYPES[data.draw(st.sampled_from(sorted(WIRE_DTYPES)))]
        elif choice == "huge":
            shape = tuple(data.draw(st.sampled_from(HUGE)))
        else:
            fmt = data.draw(st.sampled_from(["gaps1", "gaps2", "bits", "gaps1.zst", "bits.zst"]))
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else payload[:0]
    try:
        delta = decode(fmt, changed, shape, name, tensor)
    except CheckpointEngineError:
        _outcome(f"refused, {kind}")
        return
    assert not must_refuse, (fmt, name)
    _outcome(f"accepted, {kind}")
    _check_within(delta, changed)
    if kind == "genuine":
        event(f"decoded {fmt}")
        _tally[f"decoded {fmt}"] += 1
        assert _equal_bytes(delta.apply_(base.clone()), new)  # the valid payload: bit-exact


def test_delta_payloads_decode_exactly_or_are_refused():
    _share_accepted(_fuzz_delta_payloads)


# --- signed store messages -----------------------------------------------------------------
@FUZZ
@given(st.data())
def _fuzz_signed_store_messages(data):
    from rlwire.ckpt_engine._store import SignedStore

    store = SignedStore(None, b"k" * 32, "gloo")  # type: ignore[arg-type]  # no TCP store: sign, verify
    key = data.draw(st.sampled_from(["meta/0", "meta/1", "ack/3/2", "abort", ""]))
    value = data.draw(
        st.one_of(
            st.builds(
                lambda v, r: json.dumps({"version": v, "rank": r}).encode(),
                st.integers(),
                st.integers(0, 7),
            ),
            st.binary(max_size=64),
        )
    )
    signed = store.sign(key, value)
    kind = data.draw(st.sampled_from(["genuine", "genuine", "bytes", "key", "other secret"]))
    forged, asked = signed, key
    if kind == "bytes":
        forged = _mutate(signed, data.draw)
    elif kind == "key":
        asked = data.draw(st.sampled_from(["meta/0", "meta/1", "ack/3/2", "abort", ""]))
    elif kind == "other secret":
        forged = SignedStore(None, b"j" * 32, "gloo").sign(key, value)  # type: ignore[arg-type]  # as above
    try:
        got = store.verify(asked, forged)
    except CheckpointEngineError:
        _outcome(f"refused, {kind}")
        return
    _outcome(f"accepted, {kind}")
    assert (asked, got, forged) == (key, value, signed)  # only the genuine one passes


def test_signed_store_messages_verify_or_are_refused():
    _share_accepted(_fuzz_signed_store_messages)
