"""Deltas a bucket at a time (``_delta_batch``), run on CPU tensors: the same torch code as on
an accelerator. Payloads equal the per-tensor encoder's byte for byte, round trips are
bit-exact, the host reads a bucket's values a fixed number of times whatever its tensor
count, and ``delta="auto"`` sends dense where the weights are on a CUDA device, saying why."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_pair import joined_pair  # this folder: pytest puts it on sys.path
from torch.overrides import TorchFunctionMode

from rlwire.ckpt_engine import CheckpointEngineError, _delta, _delta_batch
from rlwire.ckpt_engine._delta import DeltaMirror, _diff_torch, _words, decode, pack
from rlwire.ckpt_engine._delta_batch import DeltaBatch, decode_many

FP8 = [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, *FP8, torch.int64, torch.bool]


def _bucket(dtype: torch.dtype, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, before, after)`` for one bucket of tensors: odd sizes, empty and 0-d
    tensors, nothing changed, everything changed, changes at both ends of every tensor
    (next to the tensors around it in the change mask), 20% (a bitmask), sparse changes in
    a large tensor (2-byte gaps with escapes), 1% (1-byte gaps with escapes)."""
    g = torch.Generator().manual_seed(seed)

    def make(*shape: int) -> torch.Tensor:  # any bits (NaNs too), but a bool's 0 or 1
        top = 2 if dtype == torch.bool else 256
        raw = torch.randint(0, top, (*shape, dtype.itemsize), generator=g, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    def change(t: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        words = _words(out)
        assert words is not None
        words[where] ^= 1
        return out

    out = []
    specs = [
        ("empty", (0,), None),
        ("scalar", (), "all"),
        ("one", (1,), "none"),
        ("odd7", (7,), "ends"),
        ("none", (333,), "none"),
        ("all", (129,), "all"),
        ("ends", (5, 67), "ends"),
        ("bits", (4001,), 0.2),
        ("sparse", (200_003,), 4),
        ("gaps1", (70_001,), 0.01),
        ("after", (13,), "ends"),
    ]
    for name, shape, how in specs:
        before = make(*shape)
        n = before.numel()
        if how is None or how == "none":
            where = torch.empty(0, dtype=torch.int64)
        elif how == "all":
            where = torch.arange(n)
        elif how == "ends":
            where = torch.tensor(sorted({0, n - 1}))
        elif isinstance(how, int):
            where = torch.randperm(n, generator=g)[:how]
        else:
            where = torch.randperm(n, generator=g)[: max(1, int(n * how))]
        out.append((name, before, change(before, where)))
    return out


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_as_u8(a), _as_u8(b))


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compress", ["off", "zstd"])
def test_a_bucket_encodes_as_the_per_tensor_encoder_and_round_trips_bit_exact(dtype, compress):
    bucket = _bucket(dtype, seed=DTYPES.index(dtype))
    mirror = DeltaMirror("on", compress=compress)
    for name, before, _ in bucket:
        mirror.remember(name, before)
    batch = DeltaBatch(mirror, device=True)
    for name, _, after in bucket:
        batch.add(name, after.clone())  # the caller's tensor may be reused after add
    encoded = batch.finish()
    assert len(batch) == 0 and batch.nbytes == 0
    assert [e.name for e in encoded] == [name for name, _, _ in bucket]
    forms = set()
    entries = []
    for e, (name, before, after) in zip(encoded, bucket, strict=True):
        assert _bit_equal(mirror.tensors[name], after), name  # the mirror caught up
        # The accelerators' per-tensor encoder, on the same tensors.
        prev = before.clone()
        pw = _words(prev)
        assert pw is not None
        positions, values = _diff_torch(_words(after), pw)
        fmt, k, payload = pack(after, positions, values, compress=compress)
        assert (e.format, e.changed) == (fmt, k), name
        assert (e.dtype, e.shape, e.nbytes) == (after.dtype, tuple(after.shape), after.nbytes)
        forms.add((e.format or "whole").removesuffix(".zst"))
        if fmt is None:  # whole: the mirror's copy, the same bits
            assert _bit_equal(e.payload, after), name
            continue
        assert torch.equal(e.payload, payload), (name, fmt)
        entries.append((e.format, e.changed, e.shape, dtype, e.payload))
    assert forms == {"whole", "gaps1", "gaps2", "bits"}
    # Decoded a bucket at a time, as one tensor at a time; applied, bit-exact.
    by_device = decode_many(entries, device=True)
    by_tensor = decode_many(entries, device=False)
    held = {name: before.clone() for name, before, _ in bucket}
    for entry, d, ref in zip(entries, by_device, by_tensor, strict=True):
        assert torch.equal(d.positions, ref.positions) and torch.equal(d.values, ref.values)
        name = next(e.name for e in encoded if e.payload is entry[4])
        d.apply_(held[name])
    for e, (name, _, after) in zip(encoded, bucket, strict=True):
        if e.format is None:
            held[name].copy_(e.payload)
        assert _bit_equal(held[name], after), name


def test_the_numpy_path_sends_the_same_bits_and_a_new_name_goes_whole():
    bucket = _bucket(torch.bfloat16, seed=7)
    mirror = DeltaMirror("on")
    for name, before, _ in bucket[:-1]:  # the last name is new in the update
        mirror.remember(name, before)
    batch = DeltaBatch(mirror, device=False)
    for name, _, after in bucket:
        batch.add(name, after)
    held = {name: before.clone() for name, before, _ in bucket}
    for e in batch.finish():
        if e.format is None:
            held[e.name].copy_(e.payload)
        else:
            decode(e.format, e.changed, e.shape, e.dtype, e.payload).apply_(held[e.name])
    assert all(_bit_equal(held[name], after) for name, _, after in bucket)
    assert bucket[-1][0] in mirror.tensors


class _HostReads(TorchFunctionMode):
    """Counts the torch calls that read a tensor's values on the host (each a wait for the
    device on an accelerator): ``tolist``, ``item``, ``int()``/``bool()``, ``nonzero``,
    boolean-mask indexing, copies to the CPU and the like."""

    READS = frozenset(
        {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "nonzero"}
        | {"masked_select", "cpu", "numpy", "unique", "argwhere"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        masked = name in ("__getitem__", "__setitem__") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1:2])
        )
        if name in self.READS or masked or (name == "where" and len(args) == 1):
            self.reads.append(name)
        return func(*args, **kwargs)


def _flat(items: tuple) -> list:
    out: list = []
    for item in items:
        out.extend(_flat(item) if isinstance(item, tuple | list) else [item])
    return out


@pytest.mark.parametrize("copies", [1, 8])
def test_a_bucket_reads_the_device_twice_to_encode_and_once_to_decode_whatever_its_size(copies):
    """Two reads per bucket to encode (the counts, then the escape counts), none while
    adding tensors, one to decode: the same for 11 tensors as for 88."""
    bucket = [
        (f"{name}.{i}", before, after)
        for i in range(copies)
        for name, before, after in _bucket(torch.bfloat16, seed=i)
    ]
    mirror = DeltaMirror("on")
    for name, before, _ in bucket:
        mirror.remember(name, before)
    batch = DeltaBatch(mirror, device=True)
    with _HostReads() as adding:
        for name, _, after in bucket:
            batch.add(name, after)
    with _HostReads() as finishing:
        encoded = batch.finish()
    entries = [(e.format, e.changed, e.shape, e.dtype, e.payload) for e in encoded if e.format]
    with _HostReads() as decoding:
        decode_many(entries, device=True)
    assert adding.reads == []
    assert finishing.reads == ["tolist", "tolist"]
    assert decoding.reads == ["tolist"]
    # The per-tensor encoder, for scale: several reads per tensor.
    with _HostReads() as per_tensor:
        for _, before, after in bucket:
            _diff_torch(_words(after), _words(before.clone()))
    assert len(per_tensor.reads) >= len(bucket)


def _malformed() -> dict[str, tuple]:
    base = torch.zeros(2000, dtype=torch.bfloat16)
    new = base.clone()
    new[[3, 130, 999, *range(1000, 1200, 10)]] = 1.0
    mirror = DeltaMirror("on")
    mirror.remember("w", base)
    batch = DeltaBatch(mirror, device=True)
    batch.add("w", new)
    (e,) = batch.finish()
    assert (e.format, e.changed) == ("gaps1", 23)
    payload = e.payload

    def changed(at: list[int], value: int) -> torch.Tensor:
        out = payload.clone()
        out[at] = value
        return out

    bits = torch.zeros(256 + 3 * 2, dtype=torch.uint8)  # a 250-byte mask, aligned; 3 values
    bits[0] = 0b101  # two positions set, metadata says three
    return {
        "unknown delta format 'idx'": ("idx", 23, payload),
        "but 24 gaps of 1 bytes": ("gaps1", 24, payload),
        "outside a tensor of 1100 elements": ("gaps1", 23, payload, (1100,)),
        "not a zstd frame": ("gaps1.zst", 23, payload),
        "delta of 2001 changes in a tensor of 2000": ("gaps1", 2001, payload),
        "an escaped gap that fits its width": ("gaps1", 23, changed([25], 0)),
        "with 3 escaped take 40": ("gaps1", 23, changed([4, 5], 255)),
        "delta bitmask sets 2 positions, metadata says 3": ("bits", 3, bits),
    }


@pytest.mark.parametrize("case", list(_malformed()))
def test_a_malformed_payload_is_refused_with_the_per_tensor_message_before_any_is_returned(case):
    f, changed, data, *shape = _malformed()[case]
    good = _malformed()["unknown delta format 'idx'"][2]
    entries = [
        ("gaps1", 23, (2000,), torch.bfloat16, good),  # a valid delta before it: not returned
        (f, changed, shape[0] if shape else (2000,), torch.bfloat16, data),
    ]
    with pytest.raises(CheckpointEngineError, match=case):
        decode_many(entries, device=True)
    with pytest.raises(CheckpointEngineError, match=case):
        decode_many(entries, device=False)


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "emb": torch.randn(300, 64, generator=g).bfloat16(),
        "w": torch.randn(257, 33, generator=g),
        "h": torch.randn(1000, generator=g).half(),
        "q": torch.randint(-128, 127, (999,), generator=g, dtype=torch.int8),
        "empty": torch.empty(0, 3),
        "step": torch.tensor(0),
    }
    for v in range(2, version + 1):
        for name, t in state.items():
            words = _words(t)
            assert words is not None
            share = {"h": 1.0, "step": 1.0}.get(name, 0.01)
            k = max(1, int(words.numel() * share)) if words.numel() else 0
            where = torch.randperm(words.numel(), generator=g)[:k]
            words[where] = words[where] ^ (v | 1)
    return state


def test_an_engine_sends_device_deltas_bit_exact_through_shm(monkeypatch):
    """The engine's bucket pipeline with the device path on CPU tensors: deltas from the
    second update on, bit-identical at the receiver, ``changed`` exact."""
    monkeypatch.setattr(_delta_batch, "_on_device", lambda t, device: True)
    tx, rx, _ = joined_pair(timeout=20, bucket_size=64 * 1024, sender={"delta": "on"})
    held: dict[str, torch.Tensor] = {n: torch.zeros_like(t) for n, t in _state(1).items()}

    async def run() -> list:
        version, stats = None, []
        for v in range(1, 5):
            state = _state(v)

            async def receive(version: int | None = version) -> int:
                async for name, item in rx.receive_weights(copy=False, base_version=version):
                    if isinstance(item, _delta.Delta):
                        item.apply_(held[name])
                    else:
                        held[name].copy_(item)
                assert rx.last_version is not None
                return rx.last_version

            s, version = await asyncio.gather(
                tx.send_weights(list(state.items()), version=v), receive()
            )
            for name, t in state.items():
                assert _bit_equal(held[name], t), (v, name)
            if v > 1:
                before = _state(v - 1)
                exact = sum(int((_as_words(state[n]) != _as_words(before[n])).sum()) for n in state)
                assert s.changed == exact
            stats.append(s)
        return stats

    try:
        stats = asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()
    assert [s.base for s in stats] == [None, 1, 2, 3]
    assert all(s.wire_bytes < s.bytes // 2 for s in stats[1:])
    assert all(s.delta_reason is None for s in stats)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    words = _words(t)
    assert words is not None
    return words


def test_auto_sends_dense_on_a_cuda_device_keeps_no_mirror_and_says_why(monkeypatch):
    """Where the weights are on a CUDA device ``delta="auto"`` sends every update dense from
    the first, keeps no mirror, and the stats say why (here the CPU stands in for CUDA)."""
    monkeypatch.setattr(_delta, "AUTO_DENSE_ON", ("cpu",))
    tx, rx, _ = joined_pair(timeout=20, sender={"delta": "auto"})
    stats = _updates(tx, rx, versions=3)
    assert [s.base for s in stats] == [None, None, None]
    assert all(s.wire_bytes == s.bytes for s in stats)
    assert tx.delta.nbytes == 0 and tx.delta.mode == "off"
    assert all(s.delta_reason == tx.delta.reason for s in stats)
    assert tx.delta.reason is not None and tx.delta.reason.startswith("auto: sends dense on cpu")


def test_auto_gives_up_after_a_delta_that_saved_too_little_and_says_why():
    tx, rx, _ = joined_pair(timeout=20, sender={"delta": "auto"})
    stats = _updates(tx, rx, versions=3, everything=True)
    assert [s.base for s in stats] == [None, 1, None]
    assert [s.delta_reason is None for s in stats] == [True, False, False]
    assert stats[1].delta_reason is not None
    assert "of the dense bytes (more than 50%)" in stats[1].delta_reason
    assert tx.delta.nbytes == 0


def _updates(tx, rx, *, versions: int, everything: bool = False) -> list:  # type: ignore[no-untyped-def]
    weights = {"a": torch.randn(64, 48), "b": torch.randn(100).bfloat16()}
    held = {n: torch.zeros_like(t) for n, t in weights.items()}

    async def run() -> list:
        version, stats = None, []
        for v in range(1, versions + 1):
            with torch.no_grad():
                for t in weights.values():
                    t[torch.rand(t.shape) < (1.0 if everything else 0.02)] += 1

            async def receive(version: int | None = version) -> int:
                async for name, item in rx.receive_weights(copy=False, base_version=version):
                    if isinstance(item, _delta.Delta):
                        item.apply_(held[name])
                    else:
                        held[name].copy_(item)
                assert rx.last_version is not None
                return rx.last_version

            s, version = await asyncio.gather(
                tx.send_weights(list(weights.items()), version=v), receive()
            )
            assert all(_bit_equal(held[n], t) for n, t in weights.items())
            stats.append(s)
        return stats

    try:
        return asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_bucket_synchronises_twice_to_encode_and_once_to_decode():
    """CUDA's own account (``set_sync_debug_mode``): adding tensors never waits, finishing
    a bucket waits twice, decoding it once; the payloads equal the CPU's."""
    import warnings

    bucket = _bucket(torch.bfloat16, seed=3)
    on_cpu, on_gpu = DeltaMirror("on"), DeltaMirror("on")
    for name, before, _ in bucket:
        on_cpu.remember(name, before)
        on_gpu.remember(name, before.cuda())
    expected = DeltaBatch(on_cpu, device=True)
    batch = DeltaBatch(on_gpu)
    afters = [(name, after.cuda()) for name, _, after in bucket]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as adding:
            warnings.simplefilter("always")
            for name, after in afters:
                batch.add(name, after)
        with warnings.catch_warnings(record=True) as finishing:
            warnings.simplefilter("always")
            encoded = batch.finish()
        entries = [(e.format, e.changed, e.shape, e.dtype, e.payload) for e in encoded if e.format]
        with warnings.catch_warnings(record=True) as decoding:
            warnings.simplefilter("always")
            decode_many(entries)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    synced = [
        len([w for w in ws if "synchroniz" in str(w.message)])
        for ws in (adding, finishing, decoding)
    ]
    assert synced == [0, 2, 1], [str(w.message) for w in finishing]
    for name, _, _ in bucket:
        expected.add(name, dict(afters)[name].cpu())
    for got, want in zip(encoded, expected.finish(), strict=True):
        assert (got.format, got.changed) == (want.format, want.changed)
        assert torch.equal(_as_u8(got.payload.cpu()), _as_u8(want.payload))
