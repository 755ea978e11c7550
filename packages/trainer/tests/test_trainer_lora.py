"""LoRA: adapter-only training and sync, the reference policy from the disabled adapter,
``adapter/`` in PEFT's format that merges into exactly ``hf_model/``, and the traps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_cli import checkpoint_state, train_cli  # this folder: pytest puts it on sys.path

from rlwire.trainer.config.root import ConfigError, load_config
from rlwire.trainer.models import lora
from rlwire.trainer.models.tiny import build_tiny_model


def _peft_model(path, section, dtype=torch.float32, seed=0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    wrapped = lora.wrap(model, section)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained adapter: B no longer zero
        for name, param in wrapped.named_parameters():
            if lora.is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=generator).to(dtype) * 0.1)
    return wrapped


def _untied_qwen2(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "targets",
    ["all-linear", ["q_proj", "v_proj"], ["lm_head", "q_proj"], ["embed_tokens", "q_proj"]],
)
def test_everything_that_trains_is_what_syncs_or_the_targets_are_refused(tmp_path, targets):
    """Every parameter that requires grad under LoRA is one that the weight sync, the
    checkpoints and export carry (``adapter_targets``); PEFT's embedding adapters
    (``lora_embedding_A/B``) are not, so an embedding target is refused before training."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_untied_qwen2(tmp_path / "untied"))
    section = lora.LoraSection(rank=4, alpha=8, target_modules=targets)
    if "embed_tokens" in targets:
        with pytest.raises(ValueError) as err:
            lora.wrap(model, section)
        assert str(err.value) == (
            "actor.lora.target_modules: PEFT would train ['model.embed_tokens'] with parameters "
            "other than lora_A/lora_B (an embedding's are lora_embedding_A/B), which the weight "
            "sync, checkpoints and export do not carry; adapt linear layers instead"
        )
        return
    wrapped = lora.wrap(model, section)
    trained = {lora.adapter_name(n) for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trained and trained == set(lora.adapter_targets(wrapped))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_weights_are_pefts_merge_and_unload_bit_for_bit(tmp_path, dtype):
    section = lora.LoraSection(rank=4, alpha=8, target_modules="all-linear")
    model = _peft_model(build_tiny_model(tmp_path / "tiny"), section, dtype)
    ours = dict(lora.merged_weights(model.state_dict().items(), section.scaling))
    adapter = lora.adapter_targets(model)
    merged = model.merge_and_unload().state_dict()
    assert set(ours) == set(merged)
    for name, value in merged.items():
        assert torch.equal(ours[name], value), name
    assert adapter and all(".base_layer." not in n and ".default." not in n for n in adapter)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter


def test_lora_config_verl_keys_and_refusals(tmp_path, monkeypatch):
    config = load_config(
        overrides=[
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=32",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        ]
    )
    assert (config.actor.lora.rank, config.actor.lora.alpha) == (8, 32.0)
    assert config.actor.lora.target_modules == ["q_proj", "v_proj"]
    one = load_config(overrides=["actor.lora.target_modules=o_proj"])
    assert one.actor.lora.target_modules == ["o_proj"]
    (tmp_path / "no_adapters.py").write_text(
        "from rlwire.trainer.rollout import HFEngine\n\n\n"
        "class Engine(HFEngine):\n    takes_lora = False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    refusals = {
        "actor.strategy=megatron": "actor.lora.rank: 8 is not allowed; the megatron strategy",
        "rollout.backend=no_adapters:Engine": "'no_adapters:Engine' does not take LoRA adapters",
        "actor.lora.modules_to_save=[lm_head]": "actor.lora.modules_to_save: unknown key",
        "actor.lora.target_modules=[]": "use 'all-linear' or a non-empty list",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
            load_config(overrides=["actor.lora.rank=8", override])
    with pytest.raises(ConfigError, match="actor.lora.rank: -1 is not allowed"):
        load_config(overrides=["actor.lora.rank=-1"])
    tied = lora.LoraSection(rank=4, target_modules=["lm_head", "q_proj"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "tiny"))
    with pytest.raises(ValueError, match=r"\['lm_head'\] are tied to each other"):
        lora.wrap(model, tied)
    with pytest.raises(ValueError, match="actor.lora.target_modules: Target modules"):
        lora.wrap(model, lora.LoraSection(rank=4, target_modules=["no_such_layer"]))


def _adapter_bytes(directory: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(directory / "adapter_model.safetensors"), "pt") as f:
        tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 (safe_open has no __iter__)
    return sum(t.numel() * t.element_size() for t in tensors)


def _adapter_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "adapter_model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.floor
def test_lora_run_syncs_only_the_adapter_and_exports_both_forms(ray_cluster, tmp_path):
    """Two FSDP2 ranks train rank-4 adapters with a KL term against the disabled adapter;
    every sync carries the adapter alone (its bytes are the exported adapter's; buckets of
    4 KiB split it, and it commits whole: the rollout copies' digests equal the actor's),
    the checkpoint holds the adapter and its optimizer state only, and ``adapter/`` loads
    with PEFT and merges into exactly ``hf_model/``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "lora"
    records, _ = train_cli(
        run,
        "actor.lora.rank=4",
        "actor.lora.alpha=8",
        "actor.world_size=2",
        "rollout.num_workers=1",
        "algorithm.kl_coef=0.05",
        "ckpt_engine.digest=true",
        "ckpt_engine.bucket_size=4KiB",
        "trainer.steps=3",
        "trainer.save_every=3",
        cluster=ray_cluster,
    )
    adapter_bytes = _adapter_bytes(run / "adapter")
    for r in records:
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]], r
        assert r["weight_sync_bytes"] == adapter_bytes, r
        assert r["kl_ref"] > 0 or r["step"] == 1, r
    assert len({r["weight_digest_actor"] for r in records}) == 3  # the adapter moved
    log = (run / "train.log").read_text()
    assert "LoRA rank 4 (alpha 8)" in log and "weight syncs carry the adapter only" in log
    assert f"AdamW state {2 * adapter_bytes / 2**20:.2f} MiB (full fine-tuning" in log
    assert "the KL reference is the model with its adapter disabled: no second copy" in log
    state = checkpoint_state(run / "checkpoints" / "step_3")
    assert state["model"] and all(lora.is_adapter(n) for n in state["model"])
    assert len(state["optimizer"]["state"]) == len(state["model"])  # no base-weight state
    base = AutoModelForCausalLM.from_pretrained(run / "tiny-model-seed0")
    merged = PeftModel.from_pretrained(base, run / "adapter").merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(run / "hf_model").state_dict()
    assert set(merged) == set(exported)
    for name, value in exported.items():
        assert torch.equal(merged[name], value), name
    base = AutoModelForCausalLM.from_pretrained(run / "tiny-model-seed0").state_dict()
    changed = [n for n, v in base.items() if not torch.equal(v, exported[n])]
    assert changed and all("proj" in n for n in changed)  # only adapted layers moved


@pytest.mark.parametrize(
    "mode",
    [
        ("actor.strategy=fsdp", "rollout.hybrid_engine=true"),  # in process, through naive
        ("trainer.mode=fully_async", "async.partial_rollout=true"),  # pushed beside updates
    ],
    ids=["fsdp1-hybrid", "fully-async"],
)
def test_lora_syncs_the_adapter_alone_in_the_hybrid_engine_and_fully_async(
    ray_cluster, tmp_path, mode
):
    run = tmp_path / "run"
    records, _ = train_cli(
        run,
        *mode,
        "actor.lora.rank=2",
        "actor.lora.target_modules=[q_proj,v_proj,down_proj]",
        "ckpt_engine.digest=true",
        "trainer.steps=3",
        "trainer.save_every=0",
        cluster=ray_cluster,
    )
    synced = [r for r in records if "weight_digest_actor" in r]
    assert len(synced) >= 2 and len({r["weight_digest_actor"] for r in synced}) == len(synced)
    for r in synced:
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]], r
        assert r["weight_sync_bytes"] == _adapter_bytes(run / "adapter"), r
    assert len(_adapter_names(run / "adapter")) == 2 * 3 * 2  # A, B of 3 modules in 2 layers
