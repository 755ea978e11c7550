"""Offload API on the CPU: no-op semantics, the host-copy path, pool reuse, optimizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlwire.offload import (
    PinnedPool,
    Transfer,
    load_model,
    load_optimizer,
    offload_model,
    offload_optimizer,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 8))
    model(torch.randn(4, 16)).sum().backward()  # gradients and running stats exist
    return model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="no-op semantics are for CPU-only hosts")
def test_without_accelerator_offload_is_a_completed_no_op_that_drops_grads():
    model, pool = _model(), PinnedPool()
    params = list(model.parameters())
    ptrs = [p.data_ptr() for p in params]
    t = offload_model(model, pool=pool)
    assert isinstance(t, Transfer) and t.done() and t.nbytes == 0
    assert t.wait() is t and t.seconds == 0.0 and t.gbps == 0.0
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # stayed where it was
    assert all(p.grad is None for p in model.parameters())
    assert load_model(model).nbytes == 0
    assert pool.stats().allocations == 0 and pool.stats().pinned is False


def test_grads_keep_keeps_them_and_bad_mode_is_rejected():
    model = _model()
    grads = [p.grad.clone() for p in model.parameters()]
    offload_model(model, grads="keep").wait()
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, atol=0, rtol=0)
    with pytest.raises(
        ValueError, match=r"^grads: 'free' is not allowed; use one of \('drop', 'keep'\)"
    ):
        offload_model(model, grads="free")


def test_bad_empty_cache_is_refused_before_anything_moves():
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    message = r"^empty_cache: 'yes' is not allowed; use True or False$"
    with pytest.raises(ValueError, match=message):
        offload_model(model, empty_cache="yes")
    assert all(p.grad is not None for p in model.parameters())  # grads not dropped
    with pytest.raises(ValueError, match=message):
        offload_optimizer(opt, empty_cache="yes")


def test_transfer_runs_its_completion_callback_once():
    calls = []
    t = Transfer.completed("x")
    assert t.done()
    t = Transfer(0, what="x", host_seconds=0.0, on_done=lambda: calls.append(1))
    t.wait()
    t.done()
    assert calls == [1]  # a synchronous transfer completes, and calls back, at once


def test_host_path_round_trip_is_bit_exact_and_keeps_identity():
    model, pool = _model(), PinnedPool(pin=False)
    before = _snapshot(model)
    grads = [p.grad.clone() for p in model.parameters()]
    params = list(model.parameters())
    buffers = list(model.buffers())
    t = offload_model(model, grads="keep", pool=pool, _include_host=True)
    t.wait()
    nbytes = sum(p.numel() * 4 for p in params) * 2 + sum(
        b.numel() * b.element_size() for b in buffers
    )
    assert t.nbytes == nbytes
    slab_ptr = [b for b in pool._in_use.values()][0].untyped_storage().data_ptr()
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == slab_ptr
        assert p.grad.untyped_storage().data_ptr() == slab_ptr
    _assert_equal(_snapshot(model), before)
    assert pool.stats().bytes_in_use >= nbytes
    load_model(model, "cpu").wait()
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert [id(b) for b in model.buffers()] == [id(b) for b in buffers]
    for p, g in zip(model.parameters(), grads, strict=True):
        assert p.untyped_storage().data_ptr() != slab_ptr
        torch.testing.assert_close(p.grad, g, atol=0, rtol=0)
    _assert_equal(_snapshot(model), before)
    assert pool.stats().bytes_in_use == 0


def test_second_cycle_allocates_nothing_new():
    model, pool = _model(), PinnedPool(pin=False)
    for cycle in range(3):
        offload_model(model, pool=pool, _include_host=True).wait()
        load_model(model, "cpu").wait()
        stats = pool.stats()
        assert (stats.allocations, stats.reuses) == (1, cycle)
    assert pool.release() == stats.bytes_pinned > 0
    assert pool.stats().bytes_pinned == 0


def test_offloading_twice_is_a_no_op_and_load_without_offload_too():
    model, pool = _model(), PinnedPool(pin=False)
    assert load_model(model).nbytes == 0
    assert offload_model(model, pool=pool, _include_host=True).nbytes > 0
    assert offload_model(model, pool=pool, _include_host=True).nbytes == 0
    assert pool.stats().allocations == 1
    load_model(model, "cpu")


def test_pool_rejects_bad_input():
    pool = PinnedPool(pin=False)
    with pytest.raises(ValueError, match=r"^nbytes: -1 is not allowed"):
        pool.reserve(-1)
    with pytest.raises(ValueError, match="not a buffer reserved from this pool"):
        pool.free(torch.empty(4, dtype=torch.uint8))
    block = pool.reserve(100)
    assert block.numel() >= 100 and block.dtype == torch.uint8
    pool.free(block)
    assert pool.reserve(50) is block  # the smallest free buffer that fits


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_optimizer_state_round_trip_and_training_continues_identically():
    ref, moved = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(moved.parameters(), lr=1e-2)
    _train(ref, ref_opt, 1)
    _train(moved, opt, 1)
    pool = PinnedPool(pin=False)
    state_before = {
        (i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()
    }
    t = offload_optimizer(opt, pool=pool, _include_host=True)
    offload_model(moved, pool=pool, _include_host=True)
    assert t.nbytes == sum(v.numel() * v.element_size() for v in state_before.values())
    load_optimizer(opt, "cpu").wait()
    load_model(moved, "cpu").wait()
    for (i, k), v in state_before.items():
        torch.testing.assert_close(list(opt.state.values())[i][k], v, atol=0, rtol=0)
    _train(ref, ref_opt, 2)
    _train(moved, opt, 2)
    _assert_equal(_snapshot(moved), _snapshot(ref))


def test_ddp_models_are_refused_with_the_reason():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(_model())
        with pytest.raises(
            ValueError, match=r"^offload_model: DistributedDataParallel is not supported \("
        ):
            offload_model(ddp)
        assert all(p.grad is not None for p in ddp.parameters())  # refused before any change
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_bench_without_cuda_says_so_and_succeeds(capsys):
    from rlwire.offload.bench import main

    assert main(["--gib", "0.01"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("debug", [False, True])
def test_cuda_offload_pins_and_host_reads_after_wait_are_right(debug, monkeypatch):
    if debug:
        monkeypatch.setenv("RLWIRE_OFFLOAD_DEBUG", "1")
    model = _model().cuda()
    before = _snapshot(model)
    pool = PinnedPool()
    t = offload_model(model, grads="keep", pool=pool)
    if debug:
        assert t.done()  # debug mode waited eagerly
    t.wait()
    assert t.nbytes > 0 and t.seconds > 0 and t.gbps > 0
    for p in model.parameters():
        assert p.device.type == "cpu" and p.is_pinned() and p.grad.is_pinned()
    _assert_equal({k: v.cuda() for k, v in _snapshot(model).items()}, before)
    t = load_model(model)
    assert all(p.device.type == "cuda" for p in model.parameters())
    _assert_equal(_snapshot(model), before)  # current stream already waits for the copy
    t.wait()
    offload_model(model, pool=pool).wait()
    load_model(model).wait()
    assert pool.stats().allocations == 1 and pool.stats().reuses == 1
    # A caller who never waits (the current stream already orders the load) loses no
    # pinned memory: the slab goes back to the pool fenced by the copy's event.
    for _ in range(3):
        offload_model(model, pool=pool)
        load_model(model)
    assert pool.stats().allocations == 1 and pool.stats().reuses == 4
    assert pool.stats().bytes_in_use == 0
    _assert_equal(_snapshot(model), before)
    released = pool.release()  # waits for any copy still reading a buffer, then unpins
    assert released > 0 and pool.stats().bytes_pinned == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("empty_cache", [True, False])
def test_offload_returns_device_memory_to_the_driver_once_copied(empty_cache):
    model = torch.nn.Linear(4096, 4096).cuda()  # 64 MiB of fp32 weights
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4096, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    offload_model(model, empty_cache=empty_cache).wait()
    offload_optimizer(opt, empty_cache=empty_cache).wait()
    freed = reserved - torch.cuda.memory_reserved()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if empty_cache:  # parameters, gradients and Adam's two moments went back to the driver
        assert freed >= 3 * weights, (reserved, freed)
    else:  # still cached by this process, unusable by any other
        assert freed == 0, (reserved, freed)
    load_model(model).wait()
    load_optimizer(opt).wait()
