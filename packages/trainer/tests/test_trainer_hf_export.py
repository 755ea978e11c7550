"""Any checkpoint as a Hugging Face folder, offline (``rlwire-train export``): full weights
as saved, LoRA merged exactly as PEFT merges or as PEFT's adapter, each loading in
transformers with the trained model's log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rlwire.trainer.cli import export_run, main
from rlwire.trainer.config.root import load_config, to_dict
from rlwire.trainer.errors import RunError
from rlwire.trainer.outputs import checkpoint_reader
from rlwire.trainer.outputs.checkpoint import finish_checkpoint, write_trainer_state


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from rlwire.trainer.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _run(run: Path, overrides: list[str], steps: dict[int, dict]) -> None:
    """A run directory as rlwire-train leaves it: config.yaml and complete checkpoints."""
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(overrides=overrides))))
    for step, model in steps.items():
        directory = run / "checkpoints" / f"step_{step}"
        checkpoint_reader.save({"model": model, "optimizer": {}}, directory / "actor")
        write_trainer_state(directory, {"step": step})
        finish_checkpoint(directory, step)


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


def test_a_full_weight_checkpoint_exports_as_saved_at_any_step(tmp_path, tiny_dir, capsys):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.01, alpha=1.0)
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    run = tmp_path / "run"
    _run(run, [f"model.path={tiny_dir}"], {2: state, 4: {k: v + 1 for k, v in state.items()}})
    assert main(["export", str(run), "--step", "2"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder == run / "hf_models" / "step_2"
    exported = AutoModelForCausalLM.from_pretrained(folder)
    for name, value in exported.state_dict().items():
        assert torch.equal(value, state[name]), name
    ids = torch.tensor([[5, 9, 12, 3, 7]])
    assert torch.equal(_logprobs(exported, ids), _logprobs(trained, ids))
    assert export_run(run) == run / "hf_models" / "step_4"  # the last by default
    capsys.readouterr()  # transformers' progress bars
    assert main(["export", str(run), "--step", "3"]) == 2
    assert capsys.readouterr().err == (
        f"rlwire-train: error: export: --step 3: {run} has no complete checkpoint of that step "
        "(it has 2, 4)\n"
    )
    with pytest.raises(RunError, match=r"--adapter: the run trained every weight"):
        export_run(run, adapter=True)


def test_a_lora_checkpoint_exports_merged_as_peft_merges_or_as_its_adapter(tmp_path, tiny_dir):
    from peft import PeftModel
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM

    from rlwire.trainer.models import lora

    overrides = [f"model.path={tiny_dir}", "actor.lora.rank=4", "actor.lora.alpha=8"]
    section = load_config(overrides=overrides).actor.lora
    wrapped = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_dir), section)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if lora.is_adapter(name):
                p.copy_(torch.randn_like(p) * 0.05)
    adapter = {k: v for k, v in get_model_state_dict(wrapped).items() if lora.is_adapter(k)}
    run = tmp_path / "run"
    _run(run, overrides, {3: adapter})
    ids = torch.tensor([[5, 9, 12, 3, 7]])
    want = _logprobs(wrapped, ids)
    merged = AutoModelForCausalLM.from_pretrained(export_run(run))
    peft_merged = wrapped.merge_and_unload().state_dict()
    for name, value in merged.state_dict().items():
        assert torch.equal(value, peft_merged[name]), name
    assert torch.allclose(_logprobs(merged, ids), want, atol=1e-5, rtol=0)
    folder = export_run(run, adapter=True, out=tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    loaded = PeftModel.from_pretrained(base, folder)
    assert torch.allclose(_logprobs(loaded, ids), want, atol=1e-5, rtol=0)


def test_export_out_refuses_a_folder_that_is_not_an_earlier_export(tmp_path, tiny_dir, capsys):
    """Reproduced: ``export --out DIR`` replaced DIR whole, and a file already there was
    gone. Now a new or empty folder, or an earlier export (its marker), is written or
    replaced; anything else is refused in one line and left as it was."""
    import json

    from transformers import AutoModelForCausalLM

    from rlwire.trainer.outputs.export import EXPORT_MARKER, marked_step

    state = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    run = tmp_path / "run"
    _run(run, [f"model.path={tiny_dir}"], {2: state, 4: state})
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    capsys.readouterr()  # transformers' progress bars
    assert main(["export", str(run), "--out", str(kept)]) == 2
    assert capsys.readouterr().err == (
        f"rlwire-train: error: export: --out {kept} is not empty and holds no earlier rlwire "
        f"export ({EXPORT_MARKER}); it would be replaced whole: give a new or empty folder, or "
        "one an earlier `rlwire-train export` wrote\n"
    )
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run"]  # no staging left
    with pytest.raises(RunError, match=r"^export: --out .*notes.txt is a file; give a new"):
        export_run(run, out=kept / "notes.txt")
    (tmp_path / "empty").mkdir()
    assert export_run(run, step=2, out=tmp_path / "empty") == tmp_path / "empty"
    out = tmp_path / "out"
    assert export_run(run, step=2, out=out) == out  # a new folder
    marker = {"step": 2, "run": str(run), "adapter": False}
    assert json.loads((out / EXPORT_MARKER).read_text()) == marker
    assert export_run(run, out=out) == out  # an earlier export: replaced by step 4's
    assert marked_step(out) == 4
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(value, state[name]) for name, value in exported.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine", "out", "run"]


def test_an_export_is_written_in_a_staging_folder_of_its_own(tmp_path, tiny_dir):
    """Exports of one folder shared ``<folder>.tmp``: each removed, and wrote into, the
    other's half-written one (here: another export's, as it was being written). Now each
    stages in a folder it created (``<folder>.tmp-<random>``), removed once swapped in."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    run = tmp_path / "run"
    _run(run, [f"model.path={tiny_dir}"], {2: state})
    other = tmp_path / "out.tmp"  # (the name every export staged in before)
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"another export's, being written")
    assert export_run(run, out=tmp_path / "out") == tmp_path / "out"
    assert (other / "model.safetensors").read_bytes() == b"another export's, being written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.tmp", "run"]


def test_the_runs_own_export_removes_its_cut_off_staging_and_holds_no_marker(tmp_path, tiny_dir):
    """``hf_model/`` as the run writes it (the sole writer, under the run's lock): staging
    folders a cut-off export of it left are removed, nothing else; the folder holds what
    ``save_pretrained`` writes (the marker comes after, with the step) with the mode the
    umask gives, as a folder made in place would (``mkdtemp``'s 0700 would lock out a
    server run by another user)."""
    import os

    from transformers import AutoModelForCausalLM

    from rlwire.trainer.models.modeling import save_hf_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    leftovers = ("hf_model.tmp", "hf_model.tmp-0123abcd", "hf_model.tmpl", "hf_models.tmp")
    for name in leftovers:
        (tmp_path / name).mkdir()
    target = tmp_path / "hf_model"
    save_hf_model(model.state_dict().items(), str(tiny_dir), target, "float32", sole_writer=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hf_model",
        "hf_model.tmpl",
        "hf_models.tmp",
    ]
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    __import__("transformers").AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(reference)
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in reference.iterdir())
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777 == 0o777 & ~umask
