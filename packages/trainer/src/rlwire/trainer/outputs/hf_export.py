"""Any checkpoint as a Hugging Face model, offline (``rlwire-train export RUN_DIR [--step N]
[--out DIR] [--adapter]``, :mod:`..cli`, which reads the run's ``config.yaml``): reads
``checkpoints/step_N`` (the last complete one by default) without a process group or a GPU,
and writes a folder ``transformers`` and vLLM load: the full weights, or with LoRA the
merged model (``W + B @ A x scaling``, as PEFT's ``merge_and_unload``) or, with
``adapter``, the adapter in PEFT's format. verl's ``model_merger`` does this for verl's
checkpoints; TRL writes a model in every ``checkpoint-N/``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..data.inputs import resolve_model
from ..errors import RunError
from ..models import lora
from ..models.modeling import save_hf_model
from .checkpoint_dirs import checkpoint_step, latest_checkpoint
from .checkpoint_reader import read_state
from .export import EXPORT_MARKER, export_marker, marked_step

if TYPE_CHECKING:
    from ..config.root import TrainerConfig

__all__ = ["export_checkpoint"]


def export_checkpoint(
    run_dir: Path,
    config: TrainerConfig,
    *,
    step: int | None = None,
    out: Path | None = None,
    adapter: bool = False,
) -> Path:
    """Write step ``step`` of the run at ``run_dir`` trained with ``config`` (its
    ``config.yaml``; None step: its last complete checkpoint) as a Hugging Face folder at
    ``out`` (None: ``<run_dir>/hf_models/step_<N>``, with ``adapter``
    ``<run_dir>/adapters/step_<N>``); returns the folder. The folder is written beside, in
    one of its own, and swapped in whole, marked as an export (:mod:`.export`: the step and
    the run). ``out`` may be a new or empty folder or an earlier export (replaced), nothing
    else: a folder the user keeps other files in is refused, not emptied. Raises RunError
    (one line) for a step, checkpoint or ``out`` that cannot be exported to."""
    run_dir = run_dir.resolve()
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
    if out is not None:
        _check_out(target)
    extra = {EXPORT_MARKER: export_marker(done, run=str(run_dir), adapter=adapter)}
    saved = read_state(checkpoint / "actor")["model"]
    try:
        if adapter:
            named = ((lora.adapter_name(n), v) for n, v in saved.items() if lora.is_adapter(n))
            lora.save_adapter(named, section, str(model_path), target, extra=extra)
        else:
            weights = _merged(saved, model_path, config) if section.enabled else saved.items()
            save_hf_model(weights, str(model_path), target, config.held_dtype(), extra=extra)
    except ValueError as err:  # names that do not fit the architecture: another model's
        raise RunError(f"export: {checkpoint}: {err}") from None
    return target


def _check_out(target: Path) -> None:
    """``--out`` is replaced whole: only a folder that holds nothing yet, or an earlier
    export (its marker), may be."""
    if not target.exists():
        return
    if not target.is_dir():
        raise RunError(f"export: --out {target} is a file; give a new or empty folder")
    if any(target.iterdir()) and marked_step(target) is None:
        raise RunError(
            f"export: --out {target} is not empty and holds no earlier rlwire export "
            f"({EXPORT_MARKER}); it would be replaced whole: give a new or empty folder, or "
            "one an earlier `rlwire-train export` wrote"
        )


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


def _merged(
    saved: dict, model_path: Path, config: TrainerConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights with the checkpoint's adapters merged in."""
    from transformers import AutoModelForCausalLM  # the base: sharded or not, any format

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
