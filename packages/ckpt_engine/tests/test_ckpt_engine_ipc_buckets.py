"""The per-bucket receive path of ``cuda_ipc`` (``CudaIpcEngine.receive_into``): its pieces on
CPU tensors, then the whole path over ``shm`` in one process and in three, and over
``cuda_ipc`` on a GPU (marked ``gpu``)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
import torch
from ckpt_engine_worker import make_delta_state, make_state  # this folder: on sys.path (pytest)
from engine_pair import joined_pair

from rlwire.ckpt_engine import CheckpointEngineError, registry
from rlwire.ckpt_engine._bucket_copy import IntoTargets, batched_copy_, receive_into, word_pair
from rlwire.ckpt_engine._wire import ALIGN, BucketMeta, Entry, as_bytes, dtype_name


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        ("bf16_odd", torch.randn(333, generator=g).to(torch.bfloat16)),  # 666 bytes
        ("fp32", torch.randn(5, 7, generator=g)),
        ("fp16_odd", torch.randn(3, 3, generator=g).to(torch.float16)),  # 18 bytes
        ("int64", torch.randint(-(2**62), 2**62, (9,), generator=g)),
        ("bool", torch.rand(13, generator=g) > 0.5),
        ("uint8_odd", torch.randint(0, 256, (101,), generator=g, dtype=torch.uint8)),
        ("scalar", torch.tensor(1.25)),
        ("empty", torch.empty(0, 4)),
    ]


def _packed(weights: list[tuple[str, torch.Tensor]]) -> tuple[BucketMeta, torch.Tensor]:
    """One bucket holding ``weights`` whole, each at a 256-aligned offset (the wire's layout)."""
    entries, used = [], 0
    for name, t in weights:
        offset = -(-used // ALIGN) * ALIGN
        n = t.numel() * t.element_size()
        entries.append(Entry(name, dtype_name(t.dtype), tuple(t.shape), offset, 0, n))
        used = offset + n
    buf = torch.full((used + ALIGN,), 0xAB, dtype=torch.uint8)
    for (_, t), e in zip(weights, entries, strict=True):
        buf[e.offset : e.offset + e.chunk_nbytes].copy_(as_bytes(t))
    return BucketMeta(0, 1, used, True, entries), buf


def _no_arena(index: int) -> torch.Tensor:
    raise AssertionError(f"no arena {index} here")


# --- the pieces, on CPU tensors --------------------------------------------------------------


def test_word_pair_moves_the_widest_words_that_addresses_and_length_allow():
    buf = torch.zeros(2048, dtype=torch.uint8)  # the allocator aligns its start to 64 bytes
    assert buf.data_ptr() % 64 == 0
    cases = [  # (dst offset, src offset, length) -> word
        ((0, 512, 64), torch.int64),
        ((0, 512, 20), torch.int32),  # 20 % 8 != 0
        ((4, 520, 64), torch.int32),  # the destination 4-aligned only
        ((2, 514, 64), torch.int16),  # both 2-aligned only
        ((0, 512, 666), torch.int16),  # bf16 x 333
        ((0, 512, 101), torch.uint8),  # odd length
        ((1, 512, 64), torch.uint8),  # odd address
    ]
    for (d, s, n), word in cases:
        dst, src = word_pair(buf[d : d + n], buf[s : s + n])
        assert dst.dtype == src.dtype == word, (d, s, n)
        assert dst.data_ptr() == buf.data_ptr() + d  # still views: nothing copied
        assert dst.numel() * dst.element_size() == n
    with pytest.raises(CheckpointEngineError, match="a bucket copy of 3 bytes into 4 bytes"):
        word_pair(buf[:4], buf[8:11])
    with pytest.raises(CheckpointEngineError, match="pairs flat uint8 tensors"):
        word_pair(buf[:4].view(torch.int32), buf[8:12].view(torch.int32))


def test_batched_copy_equals_a_copy_per_tensor_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (8192,), generator=g, dtype=torch.uint8)
    sizes = [1, 3, 8, 666, 0, 1000, 7, 2048, 18, 4, 64]
    src_offsets = [0, 1, 256, 512, 1300, 1300, 2400, 2600, 4800, 4830, 5000]
    dst_offsets = [0, 5, 16, 300, 1000, 1004, 2100, 2108, 4200, 4221, 4300]
    want = torch.zeros(8192, dtype=torch.uint8)
    got = torch.zeros(8192, dtype=torch.uint8)
    pairs = list(zip(sizes, src_offsets, dst_offsets, strict=True))
    for n, s, d in pairs:
        want[d : d + n].copy_(src[s : s + n])
    batched_copy_([got[d : d + n] for n, _, d in pairs], [src[s : s + n] for n, s, _ in pairs])
    assert torch.equal(got, want)
    assert got.count_nonzero() > 3700  # the copies landed (3,819 random bytes)
    with pytest.raises(CheckpointEngineError, match="a bucket copy of 1 tensors into 2"):
        batched_copy_([got[:1], got[1:2]], [src[:1]])


def test_a_bucket_is_read_through_views_of_its_flat_buffer_and_lands_bit_exact():
    weights = _mixed()
    meta, buf = _packed(weights)
    targets = {name: torch.zeros_like(t) for name, t in weights}
    into = IntoTargets(targets)
    dsts, srcs, deltas = into.copies(meta, buf, _no_arena)
    assert deltas == []
    assert len(srcs) == len(weights) - 1  # the empty tensor has no bytes to copy
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for s in srcs:  # zero-copy: every source is a view of the bucket
        assert lo <= s.data_ptr() and s.data_ptr() + s.numel() <= hi
    for d, (name, _) in zip(dsts, [w for w in weights if w[1].numel()], strict=True):
        assert d.data_ptr() == targets[name].data_ptr(), name  # straight into the target
    batched_copy_(dsts, srcs)
    into.check_complete()
    for name, t in weights:
        assert _bits_equal(targets[name], t), name


def test_a_tensor_split_over_buckets_lands_in_place_chunk_by_chunk():
    t = torch.randn(1001).to(torch.bfloat16)  # 2002 bytes, in three chunks
    raw = as_bytes(t)
    cuts = [(0, 768), (768, 1536), (1536, 2002)]
    target = torch.zeros_like(t)
    into = IntoTargets({"w": target})
    for i, (a, b) in enumerate(cuts):
        buf = torch.zeros(1024, dtype=torch.uint8)
        buf[256 : 256 + b - a].copy_(raw[a:b])
        entry = Entry("w", "bfloat16", (1001,), 256, a, b - a)
        meta = BucketMeta(i, 1, 256 + b - a, i == 2, [entry])
        assert into.apply_bucket(meta, buf, _no_arena) == b - a
        assert ("w" in into.complete) == (i == 2)
    into.check_complete()
    assert _bits_equal(target, t)


def test_mismatched_targets_are_skipped_and_named_at_the_end():
    weights = _mixed()
    meta, buf = _packed(weights)
    targets = {name: torch.zeros_like(t) for name, t in weights if name != "int64"}
    targets["fp32"] = torch.zeros(5, 7, dtype=torch.float64)  # wrong dtype
    targets["bool"] = torch.zeros(13, 2, dtype=torch.bool)[:, 0]  # not contiguous
    targets["extra"] = torch.zeros(3)  # never sent
    into = IntoTargets(targets)
    into.apply_bucket(meta, buf, _no_arena)
    with pytest.raises(CheckpointEngineError) as err:
        into.check_complete()
    message = str(err.value)
    assert "unknown names: ['int64']; missing names: ['extra']" in message, message
    assert "'fp32' is (5, 7) torch.float32 in the update but (5, 7) torch.float64" in message
    assert "the target of 'bool' is not contiguous" in message
    assert not targets["fp32"].any()  # skipped, not half-written
    assert _bits_equal(targets["bf16_odd"], weights[0][1])  # the others were written


# --- the whole path over shm, in one process --------------------------------------------------


def _targets(state: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in state}


def test_receive_into_over_shm_is_bit_exact_over_three_versions():
    tx, rx, _ = joined_pair(bucket_size=64 << 10, timeout=20, checksum=True)
    state = make_state(1, small_tensors=300)
    targets = _targets(state)
    nbytes = sum(t.numel() * t.element_size() for _, t in state)

    async def run() -> list:
        out = []
        for v in (1, 2, 3):
            sent, got = await asyncio.gather(
                tx.send_weights(make_state(v, small_tensors=300), version=v),
                receive_into(rx, targets),
            )
            for name, t in make_state(v, small_tensors=300):
                assert _bits_equal(targets[name], t.contiguous()), (v, name)
            out.append((sent, got))
        return out

    try:
        results = asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()
    for v, (sent, got) in zip((1, 2, 3), results, strict=True):
        assert got.version == v
        assert got.buckets == sent.buckets > 3  # the bigger-than-bucket tensor spans several
        assert got.bytes == nbytes and got.tensors == len(state)
        assert got.apply_seconds > 0
    assert rx.last_version == 3


def test_receive_into_applies_deltas_bit_exact():
    tx, rx, _ = joined_pair(bucket_size=64 << 10, timeout=30, sender={"delta": "on"})
    targets = _targets(make_delta_state(1))

    async def run() -> list:
        stats, held = [], None
        for v in (1, 2, 3):
            sent, got = await asyncio.gather(
                tx.send_weights(make_delta_state(v), version=v),
                receive_into(rx, targets, base_version=held),
            )
            held = got.version
            for name, t in make_delta_state(v):
                assert _bits_equal(targets[name], t.contiguous()), (v, name)
            stats.append((sent, got))
        return stats

    try:
        stats = asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()
    assert [s.base for s, _ in stats] == [None, 1, 2]
    dense = stats[0][1].bytes
    for sent, got in stats[1:]:  # only the payloads were copied out of the buckets
        assert got.bytes == sent.wire_bytes < dense // 2


def test_receive_into_consumes_a_mismatched_update_then_raises_and_the_group_goes_on():
    tx, rx, _ = joined_pair(bucket_size=4096, timeout=10)
    state = [("a", torch.randn(100)), ("b", torch.randn(7).bfloat16())]
    wrong = {"a": torch.zeros(100), "b": torch.zeros(7)}  # b: float32, sent as bf16

    async def run() -> None:
        sending = asyncio.ensure_future(tx.send_weights(state, version=1))
        with pytest.raises(CheckpointEngineError, match=r"'b' is \(7,\) torch.bfloat16"):
            await receive_into(rx, wrong)
        await asyncio.wait_for(sending, 10)  # every bucket was acknowledged
        right = {"a": torch.zeros(100), "b": torch.zeros(7, dtype=torch.bfloat16)}
        await asyncio.gather(tx.send_weights(state, version=2), receive_into(rx, right))
        for name, t in state:
            assert _bits_equal(right[name], t), name

    try:
        asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()


def test_receive_into_refuses_the_master():
    tx, rx, _ = joined_pair(bucket_size=4096, timeout=10)
    try:
        with pytest.raises(CheckpointEngineError, match=r"receive_into on the master \(rank 0\)"):
            asyncio.run(receive_into(tx, {}))
    finally:
        tx.finalize()
        rx.finalize()


# --- one sender, two receiver processes: shm here, cuda_ipc on a GPU ---------------------------

_BUCKET = 64 << 10


def _receiver(backend: str, rank: int, meta_q, out_q) -> None:
    out_q.put((rank, "up", None))  # imports done (they take 10-20 s on a busy 2-core host)
    try:
        device = torch.device("cuda", 0) if backend == "cuda_ipc" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        engine = registry.new(backend, bucket_size=_BUCKET, timeout=30, checksum=True)
        engine.prepare()
        engine.init_process_group(rank=rank, world_size=3, master_metadata=meta_q.get(timeout=60))
        state = make_state(1, small_tensors=200)
        targets = {n: torch.zeros(t.shape, dtype=t.dtype, device=device) for n, t in state}
        report = []
        for v in (1, 2, 3):
            # cuda_ipc: its own method (the bench's route); shm: the same function
            got = asyncio.run(
                engine.receive_into(targets)
                if backend == "cuda_ipc"
                else receive_into(engine, targets)
            )
            want = make_state(v, small_tensors=200)
            differ = [n for n, t in want if not _bits_equal(targets[n].cpu(), t)]
            report.append((got.version, got.buckets, differ))
        engine.finalize()
        out_q.put((rank, report, None))
    except BaseException as err:  # the parent names it
        out_q.put((rank, None, f"{type(err).__name__}: {err}"))


@pytest.mark.parametrize(
    "backend",
    [
        "shm",
        pytest.param(
            "cuda_ipc",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_two_receiver_processes_take_three_updates_bucket_by_bucket(backend):
    """The same body for shm (CPU) and cuda_ipc (GPU): every receiver's targets bit-exact
    after each of three updates, received with one batched copy per bucket."""
    ctx = multiprocessing.get_context("spawn")
    meta_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_receiver, args=(backend, r, meta_q, out_q), daemon=True) for r in (1, 2)
    ]
    for p in procs:
        p.start()
    # the engine's waits start once both receivers run (their imports are not its business)
    assert sorted(out_q.get(timeout=180)[:2] for _ in procs) == [(1, "up"), (2, "up")]
    device = torch.device("cuda", 0) if backend == "cuda_ipc" else torch.device("cpu")
    engine = registry.new(backend, bucket_size=_BUCKET, timeout=30, checksum=True, is_master=True)
    try:
        meta = engine.prepare()
        for _ in procs:
            meta_q.put(meta)
        engine.init_process_group(rank=0, world_size=3, master_metadata=meta)
        for v in (1, 2, 3):
            state = [(n, t.to(device)) for n, t in make_state(v, small_tensors=200)]
            asyncio.run(engine.send_weights(state, version=v))
        reports = sorted(out_q.get(timeout=60) for _ in procs)
    finally:
        engine.finalize()
        deadline = time.monotonic() + 30
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    for rank, report, error in reports:
        assert error is None, (rank, error)
        assert [r[0] for r in report] == [1, 2, 3]
        assert all(r[1] > 3 for r in report)  # several buckets per update
        assert all(r[2] == [] for r in report), report  # no tensor differs
