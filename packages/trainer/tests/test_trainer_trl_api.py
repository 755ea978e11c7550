"""GRPOTrainer and GRPOConfig behave as TRL's where they share a name: TRL's defaults for the
names left out, TRL's names mapped, save_model and push_to_hub refusing in one line."""

from __future__ import annotations

import pytest

from rlwire.trainer.api import TRL_DEFAULTS, GRPOConfig, GRPOTrainer
from rlwire.trainer.checks import ConfigError


def reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(c)) for c in completions]


ROWS = [{"prompt": f"{c}:"} for c in "abcdefgh"]


def test_names_left_out_take_trls_defaults_not_the_toys():
    config = GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=ROWS).config
    assert config.actor.optim.lr == TRL_DEFAULTS["learning_rate"] == 1e-6
    assert config.actor.optim.lr_scheduler_type == "linear"  # TrainingArguments' (ours: constant)
    assert config.rollout.max_new_tokens == 256 and config.rollout.n == 8
    assert config.algorithm.kl_coef == 0.0 and config.trainer.seed == 42
    assert config.trainer.total_epochs == 3  # steps from epochs, as TRL's num_train_epochs
    assert config.data.train_batch_size == 1  # 8 completions per device / 8 generations
    assert config.model.dtype == "float32"  # no GPU with bfloat16 here: TRL's bf16 is off
    given = GRPOConfig(learning_rate=3e-3, max_steps=5, per_device_train_batch_size=16)
    config = GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=ROWS, args=given).config
    assert (config.actor.optim.lr, config.trainer.steps, config.trainer.total_epochs) == (
        3e-3,
        5,
        None,
    )
    assert config.data.train_batch_size == 2


def test_trls_names_map_to_ours():
    args = GRPOConfig(
        run_name="lr-sweep-1",
        save_total_limit=2,
        eval_steps=5,
        logging_steps=10,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url="http://127.0.0.1:8000",
        hub_model_id="me/model",
    )
    config = GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=ROWS, args=args).config
    assert config.trainer.experiment_name == "lr-sweep-1"
    assert config.trainer.run_directory == "runs/rlwire/lr-sweep-1"
    assert config.trainer.max_checkpoints_to_keep == 2 and config.validation.every == 5
    assert config.rollout.backend == "vllm_server"
    assert config.rollout.server_urls == ["http://127.0.0.1:8000"]
    colocate = GRPOConfig(use_vllm=True, vllm_mode="colocate")
    config = GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=ROWS, args=colocate)
    assert config.config.rollout.backend == "vllm"
    with pytest.raises(ConfigError, match=r"^GRPOConfig.vllm_mode: 'remote' is not allowed; use"):
        GRPOConfig(vllm_mode="remote")


def test_save_and_push_before_training_or_offline_are_one_line(monkeypatch, tmp_path):
    trainer = GRPOTrainer(model="tiny", reward_funcs=reward, train_dataset=ROWS)
    with pytest.raises(ConfigError, match=r"^GRPOTrainer: train\(\) first: there is no trained"):
        trainer.save_model(str(tmp_path))
    (tmp_path / "hf_model").mkdir()
    trainer.result = type("Result", (), {"run_dir": tmp_path})()  # as after train()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as err:
        trainer.push_to_hub("me/model")
    assert str(err.value) == (
        "GRPOTrainer.push_to_hub: HF_HUB_OFFLINE is set, so the Hub cannot be reached; the "
        f"model stays in {tmp_path / 'hf_model'} (unset it, or upload that folder later)"
    )
