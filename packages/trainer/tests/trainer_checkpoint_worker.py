"""Worker on gloo ranks (CPU): actor engines saving and loading checkpoints at a world size.
Started by ``reshard.run_script``, or by hand under torchrun:

``python -m torch.distributed.run --nproc-per-node W trainer_checkpoint_worker.py ACTION DIR
CASE...``: for each case (``fsdp2``, ``fsdp``, ``fsdp2_lora``, ``megatron``) builds the
engine as ``actor.strategy`` does on the tiny model in ``DIR/tiny`` (rank 0 builds it), then

- ``save``: two optimizer steps on this rank's own batch, then the checkpoint
  ``DIR/CASE`` exactly as an actor rank writes it
  (:func:`rlwire.trainer.outputs.checkpoint.save_actor`);
- ``load``: loads ``DIR/CASE`` into the fresh engine (resharded to this world size), then
  one more optimizer step;

and rank 0 writes the engine's whole state (full tensors, by canonical name) to
``DIR/CASE.ACTION.W.pt``: after the save, after the load, and after the step that follows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from rlwire.trainer.actor import actor_engine_class
from rlwire.trainer.config.root import load_config
from rlwire.trainer.models.tiny import build_tiny_model
from rlwire.trainer.outputs.checkpoint import load_actor, save_actor

CASES = {
    "fsdp2": ["actor.strategy=fsdp2"],
    "fsdp": ["actor.strategy=fsdp"],
    "fsdp2_lora": ["actor.strategy=fsdp2", "actor.lora.rank=4", "actor.lora.alpha=8"],
    "megatron": ["actor.strategy=megatron"],
}


def _engine(case: str, model: Path):
    world = dist.get_world_size()
    config = load_config(overrides=[*CASES[case], f"actor.world_size={world}"])
    return actor_engine_class(config.actor.strategy)(config, str(model), torch.device("cpu"))


def _step(engine, seed: int, vocab: int) -> None:
    """One optimizer step on a batch of this rank's own (a different one on every rank)."""
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    ids = torch.randint(0, vocab, (2, 12), generator=generator)
    logits = engine.model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    engine.optimizer_step()


def _full(engine, case: str) -> dict[str, torch.Tensor]:
    """The engine's whole state as full tensors under flat names (a collective)."""
    if case == "megatron":
        state = engine.state()  # full already: the logical layout
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, ignore_frozen_params="lora" in case)
        model, optimizer = get_state_dict(engine.model, engine.optimizer, options=options)
        state = {"model": model, "optimizer": optimizer["state"]}
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value.detach().clone()

    walk("", state)
    return flat


def main(*, init_method: str = "env://") -> None:
    """``init_method``: where the ranks meet (torchrun's variables by default;
    ``reshard.run_script`` passes a file); the rank and world size are torchrun's variables
    either way."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    action, root, cases = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    model = root / "tiny"
    if rank == 0:
        build_tiny_model(model, seed=0)
    dist.barrier()
    vocab = AutoConfig.from_pretrained(model).vocab_size
    for case in cases:
        torch.manual_seed(0)
        engine = _engine(case, model)
        records = {}
        if action == "save":
            _step(engine, 1, vocab)
            _step(engine, 2, vocab)
            save_actor(engine, root / case, rank)
            records["saved"] = _full(engine, case)
        else:
            load_actor(engine, root / case, rank, same_world=False, reseed=0)
            records["loaded"] = _full(engine, case)
            _step(engine, 3, vocab)
            records["stepped"] = _full(engine, case)
        if rank == 0:
            torch.save(records, root / f"{case}.{action}.{world}.pt")
        dist.barrier()
    dist.barrier()  # every rank done with its collectives before any tears down
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads and interpreter finalization (trainer_megatron_worker.py)


if __name__ == "__main__":
    main()
