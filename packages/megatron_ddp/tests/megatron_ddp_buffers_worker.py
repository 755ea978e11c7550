"""Build Megatron-Core DDP and report its real buffers, on each rank of a group: run by
test_megatron_ddp_memory.py (ranks forked from one server), or by hand under torchrun.

Usage: torchrun --standalone --nproc-per-node N megatron_ddp_buffers_worker.py OUT.json [cuda]

On the CPU (gloo), a test-only shim scoped to this process's setup: megatron-core allocates
its gradient and parameter buffers on ``torch.cuda.current_device()``; it is pointed at the
CPU while the model-parallel state and the DDP wrappers are built. With ``cuda`` (NCCL, one
GPU per rank) nothing is patched, and the caching allocator's bytes taken by each wrapper
are reported too.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from unittest import mock

import torch
import torch.distributed as dist

from rlwire.megatron_ddp import build_ddp_config

CASES = {
    "conventional": {},
    "conventional_bf16_main_grads": {"main_grads_dtype": "bf16"},
    "precision_aware_fp32": {"use_precision_aware_optimizer": True},
    "precision_aware_bf16": {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"},
}


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(33, 70), torch.nn.Linear(70, 5)]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def main(out_path: str, device: str = "cpu", *, init_method: str = "env://") -> None:
    """``init_method``: where the ranks meet (torchrun's variables by default; the test
    passes a file); the rank and world size are torchrun's variables either way."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world
    )
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer import TransformerConfig

    results = []
    where = contextlib.nullcontext() if cuda else _on_the_cpu()
    with where:
        parallel_state.initialize_model_parallel()
        tconfig = TransformerConfig(
            num_layers=1,
            hidden_size=8,
            num_attention_heads=1,
            bf16=True,
            params_dtype=torch.bfloat16,
        )
        for case, optimizer in CASES.items():
            for distributed in (False, True):
                for explicit in (None, True, False):
                    overrides = {} if explicit is None else {"grad_reduce_in_fp32": explicit}
                    ddp_config = build_ddp_config(
                        optimizer, overrides, use_distributed_optimizer=distributed
                    )
                    module = _module().to(device)
                    numels = [p.numel() for p in module.parameters()]
                    before = _allocated(cuda)
                    ddp = DistributedDataParallel(tconfig, ddp_config, module)
                    grad = ddp.buffers[0].grad_data
                    results.append(
                        {
                            "case": case,
                            "optimizer": optimizer,
                            "overrides": overrides,
                            "distributed": distributed,
                            "config_grad_reduce_in_fp32": ddp_config.grad_reduce_in_fp32,
                            "buffers": len(ddp.buffers),
                            "grad_dtype": str(grad.dtype),
                            "grad_numel": grad.numel(),
                            "grad_bytes": grad.numel() * grad.element_size(),
                            "grad_device": grad.device.type,
                            "allocated_bytes": _allocated(cuda) - before if cuda else None,
                            "param_numels": numels,
                            "main_grad_is_view": all(
                                p.main_grad.untyped_storage().data_ptr()
                                == grad.untyped_storage().data_ptr()
                                for p in ddp.module.parameters()
                            ),
                        }
                    )
                    # Freed now, not while the next case's allocation is being measured
                    # (the wrapper's hooks hold it in reference cycles).
                    del ddp, grad, module
                    gc.collect()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "results": results}, f)
    parallel_state.destroy_model_parallel()
    dist.barrier()  # every rank done with its collectives before any tears down
    dist.destroy_process_group()
    _exit_without_finalizing()


def _on_the_cpu():
    return mock.patch("torch.cuda.current_device", lambda: torch.device("cpu"))


def _allocated(cuda: bool) -> int:
    if not cuda:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _exit_without_finalizing() -> None:
    # gloo's worker threads outlive destroy_process_group() and may still drop Python
    # references (needing the GIL) while the interpreter finalizes: Python then ends them
    # with pthread_exit, which aborts the rank ("terminate called without an active
    # exception"). Leave without finalizing once the report is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
