"""The pool on the CPU: exact sizes, best fit, chunked offloads, preparation ahead.

Page-locking needs CUDA; the pinned path's bookkeeping (exact bytes locked, unlocked
on release or when the last view dies, locking on the background thread) runs here with
the driver calls replaced by recorders. Everything else is the pool's own pageable path.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

from rlwire.offload import (
    PinnedPool,
    Preparation,
    _pool,
    load_model,
    offload_model,
    prepare_model,
    prepare_optimizer,
)
from rlwire.offload._layout import chunked_layout


class _Driver:
    """Stands in for cudaHostRegister / cudaHostUnregister; can hold the preparing thread."""

    def __init__(self) -> None:
        self.locked: list[tuple[int, int, str]] = []  # (ptr, bytes, thread name)
        self.unlocked: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on: int | None = None  # raise on this call (1-based)

    def lock(self, block: torch.Tensor) -> None:
        name = threading.current_thread().name
        if name == "rlwire-offload-prepare":
            assert self.gate.wait(10), "test gate never opened"
        if self.fail_on is not None and len(self.locked) + 1 == self.fail_on:
            raise RuntimeError("PinnedPool: page-locking failed (cudaError 2)")
        self.locked.append((block.data_ptr(), block.numel(), name))

    def unlock(self, ptr: int) -> None:
        self.unlocked.append(ptr)


@pytest.fixture
def driver(monkeypatch) -> _Driver:
    d = _Driver()
    monkeypatch.setattr(_pool, "_page_lock", d.lock)
    monkeypatch.setattr(_pool, "_page_unlock", d.unlock)
    return d


def _params(*numels: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.ParameterList(nn.Parameter(torch.randn(n)) for n in numels)


def test_buffers_have_the_exact_size_asked_for_not_a_power_of_two():
    pool = PinnedPool(pin=False)
    nbytes = (3 << 20) + 64  # a power-of-two rounding would make it 4 MiB
    block = pool.reserve(nbytes)
    assert block.numel() == nbytes and block.dtype == torch.uint8
    assert pool.stats().bytes_pinned == nbytes and pool.stats().buffers == 1


def test_best_fit_among_free_buffers_and_a_new_one_only_when_none_fits():
    pool = PinnedPool(pin=False)
    blocks = {n: pool.reserve(n) for n in (100, 300, 200)}
    for block in blocks.values():
        pool.free(block)
    assert pool.reserve(150) is blocks[200]
    assert pool.reserve(250) is blocks[300]
    assert pool.reserve(50) is blocks[100]
    assert pool.reserve(400).numel() == 400
    stats = pool.stats()
    assert (stats.allocations, stats.reuses, stats.buffers) == (4, 3, 4)
    assert stats.bytes_in_use == stats.bytes_pinned == 1000


def test_pinned_buffers_lock_their_exact_bytes_and_release_unlocks_them(driver):
    pool = PinnedPool(pin=True)
    block = pool.reserve(5000)
    assert driver.locked == [(block.data_ptr(), 5000, threading.current_thread().name)]
    pool.free(block)
    assert pool.reserve(4000) is block and len(driver.locked) == 1  # reused, not locked again
    pool.free(block)
    ptr = block.data_ptr()
    del block
    assert pool.release() == 5000
    assert driver.unlocked == [ptr]
    gc.collect()
    assert driver.unlocked == [ptr]  # once: release's unlock disarmed the finalizer
    assert pool.stats().bytes_pinned == 0 and pool.stats().buffers == 0


def test_a_pinned_buffer_outliving_its_pool_is_unlocked_when_its_last_view_dies(driver):
    pool = PinnedPool(pin=True)
    block = pool.reserve(1 << 16)
    ptr = block.data_ptr()
    view = block[64:128].view(torch.float32)  # what an offloaded parameter holds
    del pool, block
    gc.collect()
    assert driver.unlocked == []  # the memory is still in use: still locked
    del view
    gc.collect()
    assert driver.unlocked == [ptr]


def test_chunked_layout_packs_in_order_and_gives_a_large_tensor_its_own_buffer():
    tensors = [torch.empty(1000), torch.empty(1000), torch.empty(1000), torch.empty(5000)]
    tensors.append(torch.empty(10, dtype=torch.bfloat16))
    chunks = chunked_layout(tensors, chunk_bytes=10_000)
    # 4000 bytes each (4032 aligned to 64): two fit in 10 000, the 20 000-byte one alone.
    assert [(c.nbytes, c.indices, c.offsets) for c in chunks] == [
        (8064, (0, 1), (0, 4032)),
        (4032, (2,), (0,)),
        (20_032, (3,), (0,)),
        (64, (4,), (0,)),
    ]
    assert chunked_layout(tensors, chunk_bytes=1 << 20)[0].nbytes == 3 * 4032 + 20_032 + 64


def test_offload_reserves_one_buffer_per_chunk_and_reuses_them_every_cycle():
    model, pool = _params(1000, 1000, 1000, 5000), PinnedPool(pin=False, chunk_bytes=10_000)
    before = [p.detach().clone() for p in model.parameters()]
    for cycle in range(3):
        offload_model(model, pool=pool, _include_host=True).wait()
        blocks = list(pool._in_use.values())
        assert sorted(b.numel() for b in blocks) == [4032, 8064, 20_032]
        ptrs = {b.untyped_storage().data_ptr() for b in blocks}
        for p, ref in zip(model.parameters(), before, strict=True):
            assert p.untyped_storage().data_ptr() in ptrs
            torch.testing.assert_close(p.detach(), ref, atol=0, rtol=0)
        load_model(model, "cpu").wait()
        stats = pool.stats()
        assert (stats.allocations, stats.reuses, stats.bytes_in_use) == (3, 3 * cycle, 0)
    for p, ref in zip(model.parameters(), before, strict=True):
        assert p.untyped_storage().data_ptr() not in ptrs
        torch.testing.assert_close(p.detach(), ref, atol=0, rtol=0)


def test_an_offload_that_fails_midway_returns_its_buffers_and_leaves_the_model(monkeypatch):
    model, pool = _params(1000, 1000, 1000), PinnedPool(pin=False, chunk_bytes=4032)
    ptrs = [p.data_ptr() for p in model.parameters()]
    reserve, calls = pool.reserve, []

    def failing(nbytes: int, **kwargs) -> torch.Tensor:
        calls.append(nbytes)
        if len(calls) == 3:
            raise TimeoutError("PinnedPool.reserve: a buffer of 4032 bytes ...")
        return reserve(nbytes, **kwargs)

    monkeypatch.setattr(pool, "reserve", failing)
    with pytest.raises(TimeoutError, match="PinnedPool.reserve"):
        offload_model(model, pool=pool, _include_host=True)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert pool.stats().bytes_in_use == 0 and pool.stats().buffers == 2
    assert load_model(model).nbytes == 0  # not recorded as offloaded
    monkeypatch.undo()
    assert offload_model(model, pool=pool, _include_host=True).nbytes == 3 * 4000


def test_prepare_model_allocates_exactly_what_the_offload_reserves():
    model = _params(1000, 1000, 1000, 5000)
    pool = PinnedPool(pin=False, chunk_bytes=10_000)
    prep = prepare_model(model, pool=pool, _include_host=True)
    assert isinstance(prep, Preparation)
    assert prep.wait() is prep and prep.done() and prep.seconds >= 0
    assert sorted(prep.sizes) == [4032, 8064, 20_032] and prep.nbytes == 32_128
    assert pool.stats().allocations == 3 and pool.stats().bytes_in_use == 0
    # Already covered by free buffers: preparing again allocates nothing.
    again = prepare_model(model, pool=pool, _include_host=True)
    assert again.done() and again.nbytes == 0 and again.sizes == ()
    offload_model(model, pool=pool, _include_host=True).wait()
    stats = pool.stats()
    assert (stats.allocations, stats.reuses) == (3, 3)  # the first cycle reused every buffer
    load_model(model, "cpu").wait()


def test_prepare_optimizer_covers_its_state_and_no_accelerator_means_nothing():
    model = _params(64, 64)
    opt = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    assert prepare_optimizer(opt, _include_host=True).nbytes == 0  # no state before step()
    opt.step()
    pool = PinnedPool(pin=False)
    prep = prepare_optimizer(opt, pool=pool, _include_host=True).wait()
    # Two moments of 64 fp32 per parameter, plus the step counters, 64-byte aligned each.
    assert prep.sizes == (2 * (256 + 256 + 64),)
    if not torch.cuda.is_available():  # nothing on an accelerator: the offload moves nothing
        assert prepare_model(model, pool=pool).nbytes == 0
        assert prepare_optimizer(opt, pool=pool).nbytes == 0
    with pytest.raises(ValueError, match=r"^grads: 'free' is not allowed"):
        prepare_model(model, grads="free")


def test_preparation_runs_on_its_thread_and_reserve_waits_for_the_buffer_it_brings(driver):
    pool = PinnedPool(pin=True)
    driver.gate.clear()  # the background thread stops before page-locking
    prep = pool.prepare([1000])
    assert not prep.done() and pool.stats().bytes_preparing == 1000
    with pytest.raises(
        TimeoutError,
        match=r"^PinnedPool.prepare \(1000 bytes in 1 buffers\) did not complete within 0.05 s$",
    ):
        prep.wait(timeout=0.05)
    # A reservation that the prepared buffer will fit waits for it instead of locking again,
    with pytest.raises(TimeoutError, match=r"^PinnedPool.reserve: a buffer of 500 bytes being"):
        pool.reserve(500, timeout=0.05)
    # one that it will not fit allocates at once (here, on this thread).
    large = pool.reserve(2000, timeout=0.05)
    assert [(n, name) for _, n, name in driver.locked] == [(2000, "MainThread")]
    threading.Timer(0.1, driver.gate.set).start()
    small = pool.reserve(500, timeout=10)  # served when the preparation brings it
    assert small.numel() == 1000
    assert prep.wait(timeout=10).seconds > 0
    assert [(n, name) for _, n, name in driver.locked] == [
        (2000, "MainThread"),
        (1000, "rlwire-offload-prepare"),
    ]
    stats = pool.stats()
    assert (stats.allocations, stats.reuses, stats.bytes_preparing) == (2, 1, 0)
    pool.free(small)
    pool.free(large)


def test_a_failed_preparation_raises_on_wait_and_nobody_waits_for_its_buffers(driver):
    pool = PinnedPool(pin=True)
    driver.fail_on = 2
    prep = pool.prepare([100, 200, 300])
    with pytest.raises(RuntimeError, match=r"page-locking failed \(cudaError 2\)"):
        prep.wait(timeout=10)
    stats = pool.stats()
    assert (stats.buffers, stats.bytes_pinned, stats.bytes_preparing) == (1, 100, 0)
    driver.fail_on = None
    assert pool.reserve(300, timeout=0.5).numel() == 300  # allocated, not waited for


def test_prepare_splits_a_byte_count_into_chunks_and_release_waits_for_it(driver):
    pool = PinnedPool(pin=True, chunk_bytes=1000)
    driver.gate.clear()
    prep = pool.prepare(2500)
    assert prep.sizes == (1000, 1000, 500)
    with pytest.raises(TimeoutError, match=r"^PinnedPool.release: Preparation\("):
        pool.release(timeout=0.05)
    threading.Timer(0.1, driver.gate.set).start()
    assert pool.release(timeout=10) == 2500  # waited for the preparation, then dropped all
    assert prep.done() and len(driver.unlocked) == 3
    assert pool.stats().bytes_pinned == 0


def test_pool_and_prepare_reject_bad_input():
    with pytest.raises(ValueError, match=r"^chunk_bytes: 0 is not allowed; use an int > 0$"):
        PinnedPool(pin=False, chunk_bytes=0)
    pool = PinnedPool(pin=False)
    with pytest.raises(ValueError, match=r"^nbytes: -1 is not allowed"):
        pool.prepare(-1)
    with pytest.raises(ValueError, match=r"^nbytes\[\]: 2.5 is not allowed"):
        pool.prepare([10, 2.5])
    assert pool.stats().bytes_preparing == 0 and pool.stats().allocations == 0
