"""Offload/load round trips of FSDP2 and FSDP1 models and their optimizers, on each rank of a
group: run by test_offload_fsdp.py (ranks forked from one server), or by hand under torchrun.

Usage: torchrun --standalone --nproc-per-node N offload_fsdp_worker.py WRAPPERS DEVICE OUT.json
  WRAPPERS: comma-separated fsdp2 | fsdp1 | fsdp1_orig_params (one group serves them all)
  DEVICE: cpu (gloo, host-copy path) | cuda (nccl)

Each rank trains a reference model and an identical model that goes through two
offload/load cycles (parameters, gradients kept, optimizer state) between steps,
then compares: bit-exact values, unchanged object identity, and pool reuse. Both
models get the same in-place write right after each load.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from rlwire.offload import PinnedPool, load_model, load_optimizer, offload_model, offload_optimizer


def _wrap(wrapper: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 4)
    ).to(device)
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # An explicit mesh: the default one follows the machine's accelerator, not `device`.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=device, use_orig_params=wrapper == "fsdp1_orig_params")


def _step(model, opt, seed, device) -> float:
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(6, 24, generator=g).to(device)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep (zeroed) grads so grads="keep" has work
    return loss.item()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t._local_tensor if hasattr(t, "_local_tensor") else t).detach()


def _round_trips(wrapper: str, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    ref, moved = _wrap(wrapper, device), _wrap(wrapper, device)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(moved.parameters(), lr=1e-2)
    pool = PinnedPool()
    report: dict = {"losses_ref": [], "losses_moved": [], "checks": []}
    params = list(moved.parameters())
    for step in range(3):
        report["losses_ref"].append(_step(ref, ref_opt, step, device))
        report["losses_moved"].append(_step(moved, opt, step, device))
        # A forward without backward (old log-probs, say) right before the offload.
        with torch.no_grad():
            for model in (ref, moved):
                model(torch.ones(2, 24, device=device))
        before = [_local(p).clone() for p in moved.parameters()]
        t_model = offload_model(moved, grads="keep", pool=pool, _include_host=not cuda)
        t_opt = offload_optimizer(opt, pool=pool, _include_host=not cuda)
        t_model.wait()
        t_opt.wait()
        slabs = {b.untyped_storage().data_ptr() for b in pool._in_use.values()}
        # (FSDP1 gives original parameters outside this rank's shard an empty tensor.)
        in_pool = all(
            _local(p).untyped_storage().data_ptr() in slabs
            for p in moved.parameters()
            if _local(p).numel() > 0
        )
        on_host = all(_local(p).device.type == "cpu" for p in moved.parameters())
        pinned = all(_local(p).is_pinned() for p in moved.parameters()) if cuda else None
        host_equal = all(
            torch.equal(_local(p).cpu(), b.cpu())
            for p, b in zip(moved.parameters(), before, strict=True)
        )
        load_model(moved).wait()
        load_optimizer(opt).wait()
        back_equal = all(
            torch.equal(_local(p), b) for p, b in zip(moved.parameters(), before, strict=True)
        )
        # A write between load and the next forward must stick (a stale FSDP alias would
        # revert it at the next reshard); both models get it, so they stay equal.
        with torch.no_grad():
            for model in (ref, moved):
                for p in model.parameters():
                    _local(p).add_(0.125)
        report["checks"].append(
            {
                "nbytes": t_model.nbytes,
                "on_host": on_host,
                "in_pool": in_pool,
                "pinned": pinned,
                "host_equal_after_wait": host_equal,
                "round_trip_equal": back_equal,
                "device_after_load": str(_local(next(moved.parameters())).device),
                "identity": [id(p) for p in moved.parameters()] == [id(p) for p in params],
                "pool": pool.stats().__repr__(),
                "allocations": pool.stats().allocations,
                "reuses": pool.stats().reuses,
            }
        )
    report["params_equal"] = all(
        torch.equal(_local(a), _local(b))
        for a, b in zip(ref.parameters(), moved.parameters(), strict=True)
    )
    return report


def _exit_without_finalizing() -> None:
    # gloo's worker threads outlive destroy_process_group() and may still drop Python
    # references (needing the GIL) while the interpreter finalizes: Python then ends them
    # with pthread_exit, which aborts the rank ("terminate called without an active
    # exception"). Leave without finalizing once the report is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(wrappers: str, device_name: str, out: str, *, init_method: str = "env://") -> None:
    """``init_method``: where the ranks meet (torchrun's variables by default; the test
    passes a file); the rank and world size are torchrun's variables either way."""
    cuda = device_name == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world
    )
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    reports = {wrapper: _round_trips(wrapper, device) for wrapper in wrappers.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.barrier()  # every rank done with its collectives before any tears down
    dist.destroy_process_group()
    _exit_without_finalizing()


if __name__ == "__main__":
    main(*sys.argv[1:4])
