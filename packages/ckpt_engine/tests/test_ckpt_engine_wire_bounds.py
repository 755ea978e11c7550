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
    assert _refused(changed(0, None, row=3)) == "bucket metadata: 'w': None is not an integer >= 0"
    assert _refused(changed(0, -256, row=3)) == "bucket metadata: 'w': -256 is not an integer >= 0"
    assert _refused(changed(0, [4, -8], row=2)) == "bucket metadata: 'w': -8 is not an integer >= 0"
    assert _refused(changed(0, "float99", row=1)) == "unknown dtype 'float99' in bucket metadata"
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
