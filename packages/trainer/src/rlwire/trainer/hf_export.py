"""Any checkpoint as a Hugging Face model, offline: ``rlwire-train export RUN_DIR [--step N]
[--out DIR] [--adapter]`` reads ``checkpoints/step_N`` (the last complete one by default)
without a process group or a GPU, and writes a folder ``transformers`` and vLLM load: the
full weights, or with LoRA the merged model (``W + B @ A x scaling``, as PEFT's
``merge_and_unload``) or, with ``--adapter``, the adapter in PEFT's format. verl's
``model_merger`` does this for verl's checkpoints; TRL writes a model in every
``checkpoint-N/``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import RunError
from .outputs.checkpoint_dirs import checkpoint_step, latest_checkpoint

__all__ = ["export_checkpoint", "main"]


def export_checkpoint(
    run_dir: Path, *, step: int | None = None, out: Path | None = None, adapter: bool = False
) -> Path:
    """Write step ``step`` of the run at ``run_dir`` (None: its last complete checkpoint)
    as a Hugging Face folder at ``out`` (None: ``<run_dir>/hf_models/step_<N>``, with
    ``adapter`` ``<run_dir>/adapters/step_<N>``); returns the folder. Raises RunError (one
    line) for a run, step or checkpoint that cannot be exported."""
    from .config.root import ConfigError, load_config
    from .data.inputs import resolve_model
    from .models import lora
    from .models.modeling import save_hf_model
    from .outputs.checkpoint_reader import read_state

    run_dir = run_dir.resolve()
    if not (run_dir / "config.yaml").is_file():
        raise RunError(f"export: {run_dir} is not a run directory (no config.yaml there)")
    try:
        config = load_config(run_dir / "config.yaml")
    except ConfigError as err:
        raise RunError(f"export: {run_dir / 'config.yaml'}: {err}") from None
    checkpoint = _checkpoint(run_dir, step)
    done = checkpoint_step(checkpoint)
    model_path = resolve_model(config, run_dir, build=False)
    if not (model_path / "config.json").is_file():
        raise RunError(f"export: the run's model {model_path} is gone; it is needed to export")
    section = config.actor.lora
    if adapter and not section.enabled:
        raise RunError("export: --adapter: the run trained every weight, not a LoRA adapter")
    kind = "adapters" if adapter else "hf_models"
    target = (out or run_dir / kind / f"step_{done}").resolve()
    saved = read_state(checkpoint / "actor")["model"]
    try:
        if adapter:
            named = ((lora.adapter_name(n), v) for n, v in saved.items() if lora.is_adapter(n))
            lora.save_adapter(named, section, str(model_path), target)
        else:
            weights = _merged(saved, model_path, config) if section.enabled else saved.items()
            save_hf_model(weights, str(model_path), target, config.held_dtype())
    except ValueError as err:  # names that do not fit the architecture: another model's
        raise RunError(f"export: {checkpoint}: {err}") from None
    return target


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise RunError(f"export: {run_dir} holds no complete checkpoint")
        return found
    found = run_dir / "checkpoints" / f"step_{step}"
    if not (found / "COMPLETE").exists():
        have = sorted(
            int(p.name.removeprefix("step_"))
            for p in (run_dir / "checkpoints").glob("step_*")
            if (p / "COMPLETE").exists() and p.name.removeprefix("step_").isdigit()
        )
        raise RunError(
            f"export: --step {step}: {run_dir} has no complete checkpoint of that step (it has "
            f"{', '.join(map(str, have)) or 'none'})"
        )
    return found


def _merged(saved: dict, model_path: Path, config) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights with the checkpoint's adapters merged in."""
    from transformers import AutoModelForCausalLM  # the base: sharded or not, any format

    from .models import lora

    dtype = getattr(torch, config.held_dtype())
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).state_dict()
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in saved.items():
        if lora.is_adapter(name):
            module, rest = lora.unwrapped_name(name).split(".lora_", 1)
            halves.setdefault(module, {})[rest[0]] = value
    scaling = config.actor.lora.scaling
    for module, parts in halves.items():
        key = lora.base_name(f"{module}.weight")
        if key not in base or set(parts) != {"A", "B"}:
            raise ValueError(f"adapter {module!r} fits no weight of {model_path}")
        weight = base[key]
        base[key] = (weight + lora.merge_delta(parts["A"], parts["B"], scaling)).to(weight.dtype)
    return iter(base.items())


def main(argv: list[str]) -> int:
    """``rlwire-train export``: the command's arguments; 0, or 2 with one line."""
    import sys

    parser = argparse.ArgumentParser(
        prog="rlwire-train export",
        description="Write a checkpoint of a run as a Hugging Face model folder.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (trainer.output_dir)")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the last)")
    parser.add_argument("--out", type=Path, help="where (default: RUN_DIR/hf_models/step_N)")
    parser.add_argument(
        "--adapter", action="store_true", help="with LoRA: the adapter alone, not merged"
    )
    args = parser.parse_args(argv)
    try:
        folder = export_checkpoint(args.run_dir, step=args.step, out=args.out, adapter=args.adapter)
    except RunError as err:
        print(f"rlwire-train: error: {err}", file=sys.stderr)
        return 2
    print(folder)
    return 0
