"""Every size and offset read from another process is checked before anything is
allocated or copied from it: the bucket metadata's fields, a chunk's range in its bucket,
and the chunks of a tensor, which must follow each other with no overlap and no gap."""

from __future__ import annotations

import json

import pytest
import torch

from rlwire.ckpt_engine import CheckpointEngineError
from rlwire.ckpt_engine._wire import BucketMeta, Entry, Unpacker


def _meta(*entries: Entry, nbytes: int = 512) -> BucketMeta:
    return BucketMeta(0, 1, nbytes, True, list(entries))


def _refused(data: bytes) -> str:
    with pytest.raises(CheckpointEngineError) as err:
        BucketMeta.from_bytes(data)
    return str(err.value)


def test_metadata_with_negative_odd_or_oversized_fields_is_refused():
    good = _meta(Entry("w", "float32", (4, 8), 0, 0, 128)).to_bytes()
    assert BucketMeta.from_bytes(good).entries[0].shape == (4, 8)
    head = json.loads(good)

    def changed(at, value, row=None):
        data = json.loads(good)
        if row is None:
            data[at] = value
        else:
            data[5][0][row] = value
        return json.dumps(data).encode()

    assert _refused(b"not json").startswith("bucket metadata: malformed")
    assert _refused(changed(2, -1)) == (
        "bucket metadata: index, version and size: -1 is not an integer >= 0"
    )
    assert _refused(changed(3, "yes")) == "bucket metadata: malformed (its header)"
    for crc in (0.5, "0x1f", -1, True):  # a CRC-32 is compared and printed as an int
        assert _refused(changed(4, crc)) == (
            f"bucket metadata: checksum and base version: {crc!r} is not an integer >= 0"
        )
    assert _refused(json.dumps([*head, 1.5]).encode()) == (
        "bucket metadata: checksum and base version: 1.5 is not an integer >= 0"
    )
    assert _refused(changed(0, None, row=3)) == "bucket metadata: 'w': None is not an integer >= 0"
    assert _refused(changed(0, -256, row=3)) == "bucket metadata: 'w': -256 is not an integer >= 0"
    assert _refused(changed(0, [4, -8], row=2)) == "bucket metadata: 'w': -8 is not an integer >= 0"
    assert _refused(changed(0, "float99", row=1)).startswith(
        "bucket metadata: 'w': dtype 'float99' is not allowed; the engine sends bool, "
    )
    assert _refused(changed(0, 64, row=4)) == (  # bytes 64-192 of a tensor of 128
        "bucket metadata: 'w': a chunk of bytes 64-192 of a payload of 128"
    )
    delta = _meta(Entry("w", "float32", (4,), 0, 0, 8, None, ("gaps1", 1, 1 << 30)))
    assert _refused(delta.to_bytes()) == (
        "bucket metadata: 'w': a delta payload of 1073741824 bytes for a tensor of 16"
    )
    assert head[2] == 512


def test_a_chunk_outside_its_bucket_or_out_of_order_is_refused():
    buf = torch.arange(256, dtype=torch.uint8).repeat(2)
    outside = _meta(Entry("w", "uint8", (64,), 480, 0, 64))
    with pytest.raises(CheckpointEngineError, match=r"'w': a chunk at bytes 480-544 of a bucket"):
        list(Unpacker().unpack(outside, buf, copy=True, verify=False))
    # a 96-byte tensor in two chunks: the second claims bytes 0-48 again (overlap)
    unpacker = Unpacker()
    first = _meta(Entry("w", "uint8", (96,), 0, 0, 48))
    assert list(unpacker.unpack(first, buf, copy=True, verify=False)) == []
    overlap = _meta(Entry("w", "uint8", (96,), 256, 0, 48))
    with pytest.raises(CheckpointEngineError, match=r"chunk at byte 0 where byte 48 comes next"):
        list(unpacker.unpack(overlap, buf, copy=True, verify=False))
    gap = _meta(Entry("v", "uint8", (96,), 0, 48, 48))  # its first half never sent
    with pytest.raises(CheckpointEngineError, match=r"chunk at byte 48 where byte 0 comes next"):
        list(Unpacker().unpack(gap, buf, copy=True, verify=False))
    unpacker = Unpacker()  # in order: the tensor whole, bit for bit
    list(unpacker.unpack(first, buf, copy=True, verify=False))
    rest = _meta(Entry("w", "uint8", (96,), 256, 48, 48))
    [(name, tensor, _)] = list(unpacker.unpack(rest, buf, copy=True, verify=False))
    assert name == "w" and torch.equal(tensor, torch.cat([buf[:48], buf[256:304]]))


# --- issue 70, item 6: dtypes and shapes a peer's metadata may name ---------------------------


def _entry(dtype: str = "float32", shape: tuple = (4,), nbytes: int = 16, **more) -> Entry:
    return Entry("w", dtype, shape, 0, 0, nbytes, **more)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        # before: accepted, then torch.empty raised TypeError ("Overflow when unpacking long")
        ((0, 2**64), "shape (0, 18446744073709551616): a dimension of 18446744073709551616; "
         "each is an integer in [0, 2**63)"),
        # before: accepted, then torch.empty raised RuntimeError ("Stride calculation overflowed")
        ((0, 2**62, 2**62), "shape (0, 4611686018427387904, 4611686018427387904) of float32 "
         "spans more than 2**63 - 1 bytes"),
        ((2**61, 2, 0), "shape (2305843009213693952, 2, 0) of float32 spans more than"),
    ],
)  # fmt: skip
def test_a_shape_no_tensor_has_is_refused_as_one_engine_error(shape, message):
    raw = _meta(_entry(shape=shape, nbytes=0)).to_bytes()
    assert _refused(raw).startswith(f"bucket metadata: 'w': {message}")


def test_the_largest_shapes_a_tensor_can_have_are_taken():
    for shape in [(0, 2**63 - 1), (2**62 - 1, 0, 2)]:
        meta = BucketMeta.from_bytes(_meta(_entry("uint8", shape, 0)).to_bytes())
        [(_, tensor, _)] = list(
            Unpacker().unpack(meta, torch.zeros(512, dtype=torch.uint8), copy=True, verify=False)
        )
        assert tuple(tensor.shape) == shape and tensor.dtype == torch.uint8


@pytest.mark.parametrize("dtype", ["qint8", "quint4x2", "bits8", "complex64", "complex128",
                                   "float", "float4_e2m1fn_x2", "Tensor"])  # fmt: skip
def test_a_dtype_the_engine_does_not_send_is_refused_naming_the_allowed_ones(dtype):
    """Before: every ``torch.<name>`` dtype was taken (``qint8``, ``bits8``...), then failed
    further in, or not at all."""
    message = _refused(_meta(_entry(dtype)).to_bytes())
    assert message == (
        f"bucket metadata: 'w': dtype {dtype!r} is not allowed; the engine sends bool, uint8, "
        "int8, int16, int32, int64, uint16, uint32, uint64, float16, bfloat16, float32, "
        "float64, float8_e4m3fn, float8_e5m2"
    )


def test_every_dtype_the_engine_sends_round_trips_bit_for_bit():
    from rlwire.ckpt_engine._dtypes import WIRE_DTYPES

    for name, dtype in WIRE_DTYPES.items():
        sent = torch.arange(256, dtype=torch.uint8).repeat(2).view(dtype)[:3]
        nbytes = sent.numel() * sent.element_size()
        buf = torch.zeros(512, dtype=torch.uint8)
        buf[:nbytes] = sent.view(torch.uint8)
        meta = BucketMeta.from_bytes(_meta(_entry(name, (3,), nbytes)).to_bytes())
        [(_, got, _)] = list(Unpacker().unpack(meta, buf, copy=True, verify=False))
        assert got.dtype == dtype, name
        assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8)), name


def test_a_chunk_past_the_buckets_used_bytes_is_refused_with_the_metadata():
    """The bucket's ``nbytes`` are the bytes that travel: a chunk past them is refused when
    the metadata arrives (before: only once unpacked, against the slot's whole size)."""
    raw = _meta(Entry("w", "uint8", (512,), 256, 0, 512), nbytes=512).to_bytes()
    assert _refused(raw) == "bucket metadata: 'w': a chunk at bytes 256-768 of a bucket of 512"
    arena = _meta(Entry("w", "uint8", (512,), 4096, 0, 512, 0), nbytes=0).to_bytes()
    assert BucketMeta.from_bytes(arena).entries[0].arena == 0  # in a shared arena: not bound


@pytest.mark.parametrize("device", [False, True])
def test_a_delta_of_a_dtype_or_shape_the_engine_does_not_send_is_refused(device):
    """Before: a ``complex128`` delta raised ``KeyError`` (no 16-byte word), a 4-byte
    ``qint8`` one decoded."""
    from rlwire.ckpt_engine._delta import decode
    from rlwire.ckpt_engine._delta_batch import decode_many

    payload = torch.zeros(16, dtype=torch.uint8)
    for dtype, shape, message in [
        (torch.complex128, (4,), "delta: dtype 'complex128' is not allowed; the engine sends"),
        (torch.qint8, (4,), "delta: dtype 'qint8' is not allowed"),
        (torch.float32, (0, 2**64), "delta: shape (0, 18446744073709551616): a dimension"),
        (torch.float32, (2**62, 2), "delta: shape (4611686018427387904, 2) of float32 spans"),
    ]:
        with pytest.raises(CheckpointEngineError) as err:
            decode("gaps1", 1, shape, dtype, payload)
        assert str(err.value).startswith(message)
        with pytest.raises(CheckpointEngineError) as err:
            decode_many([("gaps1", 1, shape, dtype, payload)], device=device)
        assert str(err.value).startswith(message)


def test_a_sender_refuses_a_tensor_of_a_dtype_it_does_not_send():
    """Refused where it is given, naming it (before: sent, and each receiver failed)."""
    import asyncio

    from rlwire.ckpt_engine._wire import aiter_weights

    async def take(weights):
        return [name async for name, _ in aiter_weights(weights)]

    assert asyncio.run(take([("a", torch.zeros(2, dtype=torch.float8_e4m3fn))])) == ["a"]
    with pytest.raises(CheckpointEngineError) as err:
        asyncio.run(take([("a", torch.zeros(2)), ("z", torch.zeros(2, dtype=torch.complex64))]))
    assert str(err.value).startswith(
        "weights: 'z': dtype 'complex64' is not allowed; the engine sends bool, uint8"
    )
