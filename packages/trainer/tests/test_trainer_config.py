"""Configuration: defaults, YAML + dotted overrides, aliases and every error."""

from __future__ import annotations

import pytest

from rlwire.trainer.config.root import ConfigError, TrainerConfig, load_config, to_dict


def test_defaults_and_overrides_merge_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor:\n  world_size: 2\n  optim:\n    lr: 1e-2\nrollout:\n  n: 4\n")
    config = load_config(path, ["actor.optim.lr=3e-4", "trainer.steps=5", "ray.address=null"])
    assert isinstance(config, TrainerConfig)
    assert config.actor.world_size == 2  # from the file
    assert load_config(path).actor.optim.lr == 0.01  # "1e-2" in YAML 1.1 is a string: read as float
    assert config.actor.optim.lr == 3e-4  # the override wins over the file
    assert config.rollout.n == 4 and config.trainer.steps == 5 and config.ray.address is None
    assert config.actor.micro_batch_size is None  # default kept: one pass per mini-batch
    optim = {"lr": 3e-4, "weight_decay": 0.0, "grad_clip": 1.0, "stale_lr_kl": 0.1}
    assert to_dict(config)["actor"]["optim"].items() >= optim.items()


@pytest.mark.parametrize(("value", "policy"), [("true", "defer"), ("false", "every")])
def test_verl_alias_sets_the_grad_sync_policy(value, policy):
    config = load_config(overrides=[f"actor.fsdp.use_no_sync_for_gradient_accumulation={value}"])
    assert config.actor.grad_sync.policy == policy


def test_a_value_yaml_cannot_read_is_taken_as_text():
    assert load_config(overrides=["model.path=..."]).model.path == "..."  # YAML's document end


def test_unknown_key_lists_valid_keys_and_closest_match():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["actor.micro_batchsize=4"])
    assert str(err.value) == (
        "actor.micro_batchsize: unknown key; valid keys under actor: grad_sync, "
        "log_prob_max_token_len_per_gpu, log_prob_micro_batch_size, log_prob_use_dynamic_bsz, "
        "lora, master_dtype, megatron, "
        "micro_batch_size, mixed_precision, offload, optim, ppo_epochs, "
        "ppo_max_token_len_per_gpu, ppo_mini_batch_size, strategy, use_dynamic_bsz, "
        "use_remove_padding, world_size; did you mean 'actor.micro_batch_size'?"
    )
    with pytest.raises(
        ConfigError,
        match=r"^rolout: unknown key; valid keys under the top "
        r"level: .*; did you mean 'rollout'\?",
    ):
        load_config(overrides=["rolout.n=4"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.world_size=two", "actor.world_size: 'two' is not a int"),
        ("actor.world_size=0", "actor.world_size: 0 is not allowed; use an int >= 1"),
        ("rollout.temperature=0", "rollout.temperature: 0.0 is not allowed; use a float > 0"),
        (
            "actor.strategy=ddp",
            "actor.strategy: 'ddp' is not allowed; use 'fsdp2', 'fsdp' or 'megatron'",
        ),
        (
            "actor.grad_sync.policy=sometimes",
            # rlwire.grad_sync's own check (the trainer embeds its GradSyncConfig)
            "actor.grad_sync.policy: 'sometimes' is not a gradient-sync policy; "
            "allowed: 'defer', 'every', 'auto'",
        ),
        ("actor.offload=yes please", "actor.offload: 'yes please' is not a bool"),
        ("actor=3", "actor: expected a section (mapping), got 3"),
        (
            "actor.fsdp.use_no_sync_for_gradient_accumulation=maybe",
            "actor.fsdp.use_no_sync_for_gradient_accumulation: 'maybe' is not allowed; "
            "use one of [True, False]",
        ),
        ("novalue", "override 'novalue': expected dotted.key=value"),
        (  # checked when the config loads, not when a Ray worker builds the engine
            "ckpt_engine.bucket_size=12 parsecs",
            "ckpt_engine.bucket_size: '12 parsecs' is not allowed; use bytes as an int >= 256, "
            "a string such as '512MiB' or '2GB' (units B, KB, MB, GB, KiB, MiB, GiB), or 'auto'",
        ),
        ("ckpt_engine.timeout=0", "ckpt_engine.timeout: 0.0 is not allowed; use seconds > 0"),
        (
            "ckpt_engine.delta=sometimes",
            "ckpt_engine.delta: 'sometimes' is not allowed; use 'off', 'auto' or 'on'",
        ),
        (
            "ckpt_engine.compress=lz4",
            "ckpt_engine.compress: 'lz4' is not allowed; use 'off' or 'zstd'",
        ),
        (  # a bare YAML on/off is a boolean: it arrives as the word
            "ckpt_engine.delta=yes",
            "ckpt_engine.delta: 'on' is not allowed; ckpt_engine.backend 'naive' sends whole "
            "weights only; use 'auto' or 'off'",
        ),
        (
            "ckpt_engine.delta=on",
            "ckpt_engine.delta: 'on' is not allowed; rollout.backend 'whole_weights:Engine' takes "
            "whole weights only; use 'auto' or 'off'",
        ),
    ],
)
def test_bad_values_name_the_key(override, message, tmp_path, monkeypatch):
    # a rollout engine of a third party's that takes whole weights only
    (tmp_path / "whole_weights.py").write_text(
        "from rlwire.trainer.rollout import HFEngine\n\n\n"
        "class Engine(HFEngine):\n    takes_deltas = False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    context = {  # what makes the value impossible
        "ckpt_engine.delta=yes": ["ckpt_engine.backend=naive"],
        "ckpt_engine.delta=on": ["rollout.backend=whole_weights:Engine"],
    }.get(override, [])
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[*context, override])
    assert str(err.value) == message


def test_impossible_batch_split_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides=[
                "actor.world_size=3",
                "actor.micro_batch_size=8",
                "data.train_batch_size=2",
                "rollout.n=4",
            ]
        )
    assert str(err.value) == (
        "data.train_batch_size: 2 is not allowed; train_batch_size x rollout.n (8) must be a "
        "multiple of actor.world_size x actor.micro_batch_size (24)"
    )
    with pytest.raises(ConfigError) as err:  # one micro-batch per rank: ranks must split it
        load_config(overrides=["actor.world_size=3", "data.train_batch_size=2", "rollout.n=4"])
    assert str(err.value) == (
        "data.train_batch_size: 2 is not allowed; train_batch_size x rollout.n (8) must be a "
        "multiple of actor.world_size (3)"
    )


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^--config: cannot read .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match=r"^--config: .*bad.yaml is not valid YAML"):
        load_config(bad)
    flat = tmp_path / "flat.yaml"
    flat.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(flat)


def test_the_docs_generate_the_reference_and_verls_keys_from_the_code():
    """The pages hold each table between its markers (rendered by ``docs/hooks.py --write``;
    tests/test_docs_pages.py checks they are current), and the functions behind them run."""
    from pathlib import Path

    from rlwire.trainer.config import describe_config
    from rlwire.trainer.config.verl_keys import alias_table

    root = Path(__file__).resolve().parents[3]
    reference = (root / "docs" / "reference" / "configuration.md").read_text().splitlines()
    verl = (root / "docs" / "integrations" / "verl.md").read_text().splitlines()
    assert "<!-- config-reference -->" in reference and "<!-- verl-keys -->" in verl
    assert "| `trainer.total_epochs` |" in describe_config()
    assert "| `actor_rollout_ref.model.use_shm` | (accepted: changes nothing) |" in alias_table()


def test_checkpoint_engine_defaults_are_the_librarys():
    from rlwire.ckpt_engine import DEFAULT_BUCKET_SIZE, DEFAULT_TIMEOUT_S, parse_bucket_size

    engine = load_config().ckpt_engine
    assert parse_bucket_size(engine.bucket_size) == DEFAULT_BUCKET_SIZE
    assert engine.timeout == DEFAULT_TIMEOUT_S


def test_ppo_mini_batches_must_split_the_batch_and_partial_rollouts_need_a_capable_engine():
    config = load_config(overrides=["actor.ppo_mini_batch_size=2", "actor.ppo_epochs=3"])
    assert config.mini_batch_rows() == 2 * 8 and config.actor.ppo_epochs == 3
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["actor.micro_batch_size=8", "actor.ppo_mini_batch_size=3"])
    assert str(err.value) == (
        "actor.ppo_mini_batch_size: 3 is not allowed; it must divide data.train_batch_size "
        "(8), and ppo_mini_batch_size x rollout.n must be a multiple of actor.world_size x "
        "actor.micro_batch_size (8)"
    )
    with pytest.raises(ConfigError, match=r"^actor.ppo_epochs: 0 is not allowed; use an int >= 1"):
        load_config(overrides=["actor.ppo_epochs=0"])
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides=[
                "trainer.mode=fully_async",
                "async.partial_rollout=true",
                "rollout.backend=rlwire.trainer.rollout.base:RolloutEngine",
            ]
        )
    assert str(err.value) == (
        "async.partial_rollout: True is not allowed; rollout.backend "
        "'rlwire.trainer.rollout.base:RolloutEngine' takes no requests (neither "
        "serves_requests nor a rlwire.trainer.rollout.PartialRolloutEngine); set it to false"
    )


VERL_YAML = """
data:
  train_files: [/data/gsm8k/train.parquet]
  train_batch_size: 16
  max_response_length: 64
actor_rollout_ref:
  model:
    path: /models/qwen
  actor:
    strategy: fsdp2
    optim: {lr: 1.0e-6, weight_decay: 0.01}
    ppo_mini_batch_size: 4
    ppo_micro_batch_size_per_gpu: 4
    ppo_epochs: 2
    clip_ratio: 0.28
    use_kl_loss: true
    kl_loss_coef: 0.002
    kl_loss_type: low_var_kl
    loss_agg_mode: seq-mean-token-mean
    use_dynamic_bsz: false
    fsdp_config:
      param_offload: true
      optimizer_offload: true
      use_no_sync_for_gradient_accumulation: false
  rollout:
    name: vllm
    n: 4
    temperature: 0.9
    gpu_memory_utilization: 0.4
    checkpoint_engine:
      backend: shm
      update_weights_bucket_megabytes: 512
algorithm:
  adv_estimator: grpo
  norm_adv_by_std_in_grpo: false
  rollout_correction: {rollout_is: sequence, rollout_is_threshold: 3.0}
custom_reward_function:
  path: /code/reward.py
  name: my_score
trainer:
  total_training_steps: 7
  save_freq: -1
  default_local_dir: /runs/verl
  resume_mode: disable
async_training:
  staleness_threshold: 0.5
"""


def test_a_verl_yaml_maps_to_rlwire_keys(tmp_path):
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(VERL_YAML)
    c = load_config(path)
    assert (c.data.source, c.data.train_batch_size) == ("/data/gsm8k/train.parquet", 16)
    assert (c.rollout.max_new_tokens, c.model.path, c.actor.strategy) == (
        64,
        "/models/qwen",
        "fsdp2",
    )
    assert (c.actor.optim.lr, c.actor.optim.weight_decay) == (1e-6, 0.01)
    assert (c.actor.ppo_mini_batch_size, c.actor.micro_batch_size, c.actor.ppo_epochs) == (4, 4, 2)
    assert (c.algorithm.clip_ratio, c.algorithm.kl_coef) == (0.28, 0.002)
    assert c.algorithm.loss_agg == "seq-mean-token-mean" and not c.algorithm.norm_adv_by_std
    assert c.actor.offload and str(c.actor.grad_sync.policy) == "every"
    assert (c.rollout.backend, c.rollout.n, c.rollout.temperature) == ("vllm", 4, 0.9)
    assert c.rollout.vllm.gpu_memory_utilization == 0.4
    assert (c.ckpt_engine.backend, c.ckpt_engine.bucket_size) == ("shm", "512MiB")
    assert c.algorithm.rollout_correction.rollout_is == "sequence"
    assert c.reward.function == "/code/reward.py:my_score"
    assert (c.trainer.steps, c.trainer.save_every, c.trainer.output_dir) == (7, 0, "/runs/verl")
    assert c.trainer.resume == "never" and c.async_.staleness_threshold == 0.5


def test_verl_keys_for_missing_features_are_refused_together(tmp_path):
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(
        VERL_YAML
        + "critic:\n  ppo_epochs: 1\n"
        + "reward_model:\n  enable: false\n"  # off: nothing asked for, accepted
    )
    with pytest.raises(ConfigError) as err:
        load_config(
            path,
            overrides=[
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "data.return_raw_chat=true",
                "algorithm.adv_estimator=grpo",
            ],
        )
    assert str(err.value) == (
        "verl keys for features rlwire-train does not have: "
        "critic.ppo_epochs=1, actor_rollout_ref.actor.ulysses_sequence_parallel_size=2, "
        "data.return_raw_chat=True; remove them (or set them off: false, null or 0). The "
        "mapped keys: docs/integrations/verl.md (verl's keys)"
    )
    with pytest.raises(ConfigError) as err:  # no critic here: GAE needs one
        load_config(overrides=["algorithm.adv_estimator=gae"])
    assert str(err.value) == (
        "algorithm.adv_estimator: 'gae' is not allowed; use 'grpo', 'rloo', "
        "'reinforce_plus_plus' or 'reinforce_plus_plus_baseline'"
    )
    with pytest.raises(ConfigError, match=r"^algorithm.gamma: 0.99 is not allowed; use one of"):
        load_config(overrides=["algorithm.gamma=0.99"])
    with pytest.raises(ConfigError, match=r"kl_loss_type: 'mse' is not allowed; rlwire-train"):
        load_config(overrides=["actor_rollout_ref.actor.kl_loss_type=mse"])


def test_the_hybrid_engine_is_on_where_it_can_be_and_refused_where_it_cannot():
    assert load_config().hybrid_engine()  # the default job: one rank, hf, colocated
    assert load_config(overrides=["actor.world_size=2", "rollout.num_workers=2"]).hybrid_engine()
    assert not load_config(overrides=["rollout.hybrid_engine=false"]).hybrid_engine()
    assert (
        load_config(overrides=["actor_rollout_ref.hybrid_engine=false"]).rollout.hybrid_engine
        is False
    )
    cases = [
        ("trainer.mode=fully_async", "trainer.mode='fully_async' (colocated only)"),
        ("rollout.backend=vllm", "rollout.backend='vllm' runs in its own process"),
        (
            "actor.world_size=2",
            "rollout.num_workers=1 (one engine per actor rank: actor.world_size=2)",
        ),
        ("ckpt_engine.backend=gloo", "ckpt_engine.backend='gloo' (in process: 'auto' or 'naive')"),
        ("ckpt_engine.delta=on", "ckpt_engine.delta='on' (the in-process hand-over sends whole"),
    ]
    for override, obstacle in cases:
        assert not load_config(overrides=[override]).hybrid_engine()  # auto: off
        with pytest.raises(ConfigError) as refused:
            load_config(overrides=[override, "rollout.hybrid_engine=true"])
        assert str(refused.value).startswith(
            f"rollout.hybrid_engine: True is not allowed; it cannot be on with {obstacle}"
        )


def test_automatic_worker_threads_follow_the_model_size_and_the_processes_computing_at_once():
    big, small = 24_000_000, 76_000
    assert load_config().worker_threads(small, 2) == 1  # the default job: one thread
    assert load_config().worker_threads(big, 2) == 2  # hybrid, one rank: the node's cores
    two_ranks = ["actor.world_size=2", "rollout.num_workers=2"]
    assert load_config(overrides=two_ranks).worker_threads(big, 8) == 4  # hybrid: 2 at once
    separate = ["actor.world_size=2", "rollout.num_workers=3", "rollout.hybrid_engine=false"]
    assert load_config(overrides=separate).worker_threads(big, 8) == 2  # alternating: max
    fully_async = ["trainer.mode=fully_async", "rollout.num_workers=3"]
    assert load_config(overrides=fully_async).worker_threads(big, 8) == 2  # 1 + 3 at once
    assert load_config(overrides=fully_async).worker_threads(big, 2) == 1  # never below one
    assert load_config(overrides=["ray.worker_threads=3"]).worker_threads(small, 2) == 3
    with pytest.raises(ConfigError, match=r"^ray.worker_threads: 0 is not allowed; use an int"):
        load_config(overrides=["ray.worker_threads=0"])


def test_rlwire_train_finds_the_users_modules_in_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    """``agent.function=mypkg_agent:solve`` next to the command imports, as ``python -m``
    would find it, and the workers the run starts inherit the folder (``PYTHONPATH``)."""
    import os
    import sys

    from rlwire.trainer import cli

    (tmp_path / "mypkg_agent.py").write_text("async def solve(row, client):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert cli.main(["--print-config", "agent.function=mypkg_agent:solve"]) == 0
    assert "function: mypkg_agent:solve" in capsys.readouterr().out
    assert sys.path[-1] == str(tmp_path)
    assert os.environ["PYTHONPATH"].split(os.pathsep) == ["/elsewhere", str(tmp_path)]


def test_a_sigterm_stop_that_ray_wraps_in_a_system_error_is_still_one_line(monkeypatch, capsys):
    """The SIGTERM handler's ``RunError`` raised while Ray's Cython checks signals inside a
    wait comes out as the cause of a ``SystemError`` (the fault campaign: a driver SIGTERMed
    during a push ended with that traceback): the command still stops with its one line."""
    from rlwire.trainer import cli, driver
    from rlwire.trainer.errors import RunError

    def stopped(*_args, **_kwargs):
        try:
            raise RunError("stopped by SIGTERM; the last checkpoint in the run directory is intact")
        except RunError as err:
            raise SystemError("<cyfunction CoreWorker.wait> returned a result") from err

    monkeypatch.setattr(driver, "run", stopped)
    assert cli.main(["trainer.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "rlwire-train: error: stopped by SIGTERM; the last checkpoint in the run directory is "
        "intact"
    )
    assert "Traceback" not in err

    def broken(*_args, **_kwargs):  # any other SystemError is not hidden
        raise SystemError("something else")

    monkeypatch.setattr(driver, "run", broken)
    with pytest.raises(SystemError, match="something else"):
        cli.main(["trainer.steps=1"])
