"""Worker on 2 gloo ranks (CPU): the Megatron actor engine on the tiny model (started by
``reshard.run_script``, or by hand under torchrun).

For each case it builds the engine exactly as ``actor.strategy=megatron`` does and records
the real ``DistributedDataParallelConfig``, the gradient buffers' dtypes, the optimizer
class and the ``check_consistency`` warnings (or the error) as JSON at argv[1].
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rlwire.trainer.actor.megatron import MegatronActor
from rlwire.trainer.config.root import load_config
from rlwire.trainer.models.tiny import build_tiny_model

# (name, overrides, build the optimizer too)
CASES = [
    ("fp32_main_grads", [], False),
    ("bf16_main_grads_without_precision_aware", ["optimizer.main_grads_dtype=bf16"], False),
    ("precision_aware_fp32", ["optimizer.use_precision_aware_optimizer=true"], False),
    (
        "precision_aware_bf16",
        ["optimizer.use_precision_aware_optimizer=true", "optimizer.main_grads_dtype=bf16"],
        False,
    ),
    ("explicit_bf16_reduce", ["override_ddp_config.grad_reduce_in_fp32=false"], False),
    (
        "explicit_fp32_reduce_precision_aware_bf16",
        [
            "optimizer.use_precision_aware_optimizer=true",
            "optimizer.main_grads_dtype=bf16",
            "override_ddp_config.grad_reduce_in_fp32=true",
        ],
        False,
    ),
    ("engine_distributed_optimizer", [], True),
    ("engine_plain_optimizer", ["use_distributed_optimizer=false"], True),
    ("engine_precision_aware_on_cpu", ["optimizer.use_precision_aware_optimizer=true"], True),
]


def main(*, init_method: str = "env://") -> None:
    """``init_method``: where the ranks meet (torchrun's variables by default;
    ``reshard.run_script`` passes a file); the rank and world size are torchrun's variables
    either way."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    out = Path(sys.argv[1])
    path = out.parent / "tiny"
    if dist.get_rank() == 0:
        build_tiny_model(path, seed=0)
    dist.barrier()
    results = []
    for name, overrides, with_optimizer in CASES:
        config = load_config(
            overrides=[
                "actor.strategy=megatron",
                "model.dtype=bfloat16",
                *[f"actor.megatron.{o}" for o in overrides],
            ]
        )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        record = {"case": name}
        try:
            engine = MegatronActor(config, model, torch.device("cpu"), optimizer=with_optimizer)
            ddp = engine.ddp_config
            record.update(
                ddp={f.name: repr(getattr(ddp, f.name)) for f in dataclasses.fields(ddp)},
                ddp_type=f"{type(ddp).__module__}.{type(ddp).__name__}",
                buffers=[str(d) for d in engine.grad_buffer_dtypes()],
                main_grad_is_buffer_view=all(
                    p.main_grad.untyped_storage().data_ptr()
                    == engine.model.buffers[0].grad_data.untyped_storage().data_ptr()
                    for p in engine.model.module.parameters()
                ),
                optimizer=type(engine.optimizer).__name__ if engine.optimizer else None,
                inner=[
                    type(o).__name__ for o in getattr(engine.optimizer, "chained_optimizers", [])
                ],
                warnings=engine.warnings,
            )
        except (ValueError, RuntimeError) as err:
            record["error"] = str(err)
        results.append(record)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"world_size": dist.get_world_size(), "results": results}))
    dist.barrier()  # every rank done with its collectives before any tears down
    dist.destroy_process_group()
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    # gloo's worker threads outlive destroy_process_group() and may still drop Python
    # references (needing the GIL) while the interpreter finalizes: Python then ends them
    # with pthread_exit, which aborts the rank ("terminate called without an active
    # exception"). Leave without finalizing once the report is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
