"""The memory model: reference points, consistency warnings, and real Megatron buffers."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import megatron_ddp_buffers_worker  # this folder: pytest puts it on sys.path
import pytest
import torch
from torch.multiprocessing.spawn import start_processes

from rlwire.megatron_ddp import (
    MemoryBreakdown,
    check_consistency,
    grad_buffer_numel,
    grad_memory_bytes_per_param,
    resolve_ddp_overrides,
)
from rlwire.megatron_ddp._table import memory_table

HERE = Path(__file__).resolve().parent

# CPU ranks are forked from multiprocessing's fork server, which imports torch, megatron-core
# and the worker once (what it preloads is set in conftest.py, once for the process). CUDA
# ranks are spawned instead (see _start_method).


def _start_method(device: str) -> str:
    """``forkserver`` on the CPU; ``spawn`` (a fresh interpreter per rank) on CUDA.

    Importing megatron-core starts CUDA where there is a GPU (the H200 run: the preload
    did, and every forked rank then failed with "Cannot re-initialize CUDA in forked
    subprocess"). CUDA survives no fork, so no rank that uses it may come from a process
    that started it: spawned ranks import everything themselves (slower, GPU only).
    """
    return "spawn" if device == "cuda" else "forkserver"


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_reference_point_conventional_fp32_buffer_distributed(d):
    m = grad_memory_bytes_per_param(
        param_dtype=torch.bfloat16,
        ddp_config={"grad_reduce_in_fp32": True, "use_distributed_optimizer": True},
        optimizer_config={},
        dp_size=d,
    )
    assert m == MemoryBreakdown(
        param=2,
        grad_buffer=4,
        main_grads=0,
        master_params=4 / d,
        optimizer_moments=8 / d,
        transient_main_grads=0,
    )
    assert m.total == m.persistent == 6 + 12 / d


@pytest.mark.parametrize("d", [1, 8])
def test_bf16_buffer_with_conventional_optimizer_adds_a_transient_fp32_copy(d):
    m = grad_memory_bytes_per_param(
        param_dtype="bf16",
        ddp_config={"grad_reduce_in_fp32": False, "use_distributed_optimizer": True},
        optimizer_config={"optimizer": "adam"},
        dp_size=d,
    )
    assert m.grad_buffer == 2
    assert m.transient_main_grads == 4 / d
    assert m.persistent == 4 + 12 / d
    assert m.total == 4 + 16 / d


def test_precision_aware_bf16_everything():
    m = grad_memory_bytes_per_param(
        param_dtype="bf16",
        ddp_config={"grad_reduce_in_fp32": False, "use_distributed_optimizer": True},
        optimizer_config={
            "use_precision_aware_optimizer": True,
            "main_grads_dtype": "bf16",
            "main_params_dtype": "bf16",
            "exp_avg_dtype": "bf16",
            "exp_avg_sq_dtype": "bf16",
        },
        dp_size=4,
    )
    assert (m.grad_buffer, m.master_params, m.optimizer_moments, m.transient_main_grads) == (
        2,
        0.5,
        1.0,
        0,
    )


def test_fp32_params_without_distributed_optimizer_need_no_master_copy():
    m = grad_memory_bytes_per_param(
        param_dtype=torch.float32, ddp_config={}, optimizer_config={}, dp_size=8
    )
    assert m == MemoryBreakdown(
        param=4,
        grad_buffer=4,
        main_grads=0,
        master_params=0,
        optimizer_moments=8,
        transient_main_grads=0,
    )


def test_sgd_and_bad_inputs():
    m = grad_memory_bytes_per_param(
        param_dtype="bf16",
        ddp_config={"grad_reduce_in_fp32": True},
        optimizer_config={"optimizer": "sgd"},
        dp_size=2,
    )
    assert m.optimizer_moments == 4
    with pytest.raises(ValueError, match=r"^optimizer: 'lion' has no memory model; known: "):
        grad_memory_bytes_per_param(
            param_dtype="bf16", ddp_config={}, optimizer_config={"optimizer": "lion"}, dp_size=1
        )
    with pytest.raises(ValueError, match=r"^dp_size: 0 is not allowed"):
        grad_memory_bytes_per_param(
            param_dtype="bf16", ddp_config={}, optimizer_config={}, dp_size=0
        )
    with pytest.raises(ValueError, match=r"^param_dtype: 'int8' is not an accepted dtype"):
        grad_memory_bytes_per_param(
            param_dtype="int8", ddp_config={}, optimizer_config={}, dp_size=1
        )


def test_consistency_flags_the_bf16_buffer_double_allocation():
    warnings = check_consistency({"grad_reduce_in_fp32": False}, {"bf16": True})
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "grad_reduce_in_fp32=False with the conventional optimizer: gradients are reduced in "
        "the parameter dtype and the optimizer allocates an fp32 main-grad copy"
    )


@pytest.mark.parametrize(
    "optimizer",
    [
        {},
        {"main_grads_dtype": "bf16"},
        {"use_precision_aware_optimizer": True},
        {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"},
    ],
)
def test_resolved_configs_are_consistent(optimizer):
    ddp = resolve_ddp_overrides(optimizer, {"use_distributed_optimizer": True})
    assert check_consistency(ddp, optimizer) == []


def test_consistency_flags_wasted_fp32_buffer_and_missing_distributed_optimizer():
    warnings = check_consistency(
        {"grad_reduce_in_fp32": True, "use_distributed_optimizer": False},
        {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"},
    )
    assert [w.split(":")[0] for w in warnings] == [
        "grad_reduce_in_fp32=True with a precision-aware optimizer whose main_grads_dtype "
        "is torch.bfloat16",
        "use_precision_aware_optimizer requires the distributed optimizer; set "
        "use_distributed_optimizer=True in the DDP config",
    ]


def test_readme_table_is_the_one_the_package_prints():
    readme = (HERE.parent / "README.md").read_text()
    assert memory_table() in readme


def _buffers(out: Path, ranks: int, device: str) -> dict:
    """Megatron-Core DDP's real buffers, built on ``ranks`` ranks on ``device``."""
    main, method = megatron_ddp_buffers_worker.main, _start_method(device)
    _on_ranks(main, ranks, str(out), device, start_method=method)
    return json.loads(out.read_text())


def _on_ranks(
    main, nproc: int, *args: str, start_method: str = "forkserver", timeout: float = 300
) -> None:
    """``main(*args, init_method=...)`` on ``nproc`` ranks with the rank variables torchrun
    would set, forked from multiprocessing's fork server by default (torch imported there
    once, not per rank). The ranks meet through a file (a FileStore), not a port picked here
    that another process could take before rank 0 binds it. A rank that raises or exits
    non-zero fails the test with its error; all are killed after ``timeout`` s."""
    with tempfile.TemporaryDirectory(prefix="rlwire-ranks-") as meeting:
        store = f"file://{os.path.join(meeting, 'store')}"
        ranks = start_processes(
            _rank,
            args=(main, nproc, store, args),
            nprocs=nproc,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ranks.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{nproc} ranks did not finish within {timeout:g} s")
        finally:
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)


def _rank(rank: int, main, world: int, store: str, args: tuple[str, ...]) -> None:
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
    env |= {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    os.environ.update(env)
    torch.set_num_threads(1)  # the fork server read OMP_NUM_THREADS when it imported torch
    main(*args, init_method=store)


@pytest.fixture(scope="module")
def megatron_buffers(tmp_path_factory) -> dict:
    return _buffers(tmp_path_factory.mktemp("mcore") / "buffers.json", 2, "cpu")


def test_real_buffers_match_resolution_and_memory_model(megatron_buffers):
    _check_buffers(megatron_buffers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_buffers_match_resolution_and_memory_model(tmp_path):
    """On one GPU (NCCL, no shim): the buffers are on the device, as the model says, and the
    caching allocator gave each wrapper at least its gradient buffer."""
    buffers = _buffers(tmp_path / "buffers.json", 1, "cuda")
    _check_buffers(buffers)
    for r in buffers["results"]:
        assert r["grad_device"] == "cuda", r
        assert r["allocated_bytes"] >= r["grad_bytes"], r


def _check_buffers(megatron_buffers: dict) -> None:
    results = megatron_buffers["results"]
    d = megatron_buffers["world_size"]
    assert len(results) == 4 * 2 * 3
    for r in results:
        explicit = r["overrides"].get("grad_reduce_in_fp32")
        expected_fp32 = explicit if explicit is not None else r["case"] != "precision_aware_bf16"
        assert r["config_grad_reduce_in_fp32"] is expected_fp32, r
        assert r["grad_dtype"] == ("torch.float32" if expected_fp32 else "torch.bfloat16"), r
        assert r["buffers"] == 1
        ddp = {"grad_reduce_in_fp32": expected_fp32, "use_distributed_optimizer": r["distributed"]}
        model = grad_memory_bytes_per_param(
            param_dtype="bf16", ddp_config=ddp, optimizer_config=r["optimizer"], dp_size=d
        )
        numel = grad_buffer_numel(
            r["param_numels"], dp_size=d, use_distributed_optimizer=r["distributed"]
        )
        assert r["grad_numel"] == numel, r
        assert r["grad_bytes"] == model.grad_buffer * numel, r
        if not r["distributed"]:
            assert numel == sum(r["param_numels"])  # no padding without the dist. optimizer
        # Main grads are views of the buffer: with an fp32 buffer the conventional
        # optimizer needs no copy (transient 0).
        assert r["main_grad_is_view"]
