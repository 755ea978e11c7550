"""From the toy to a real run: verl's GSM8K GRPO example as it is written (a tiny model of
its architecture behind its Hub id, in an offline cache; verl-format parquet), TRL's
``GRPOTrainer`` shape with a ``datasets.Dataset`` and TRL-signature rewards, Hub ids, rewards
chosen by ``data_source``, and the settings a real model needs."""

from __future__ import annotations

import hashlib
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_cli import metrics, train_cli

from rlwire.trainer.config import ConfigError, load_config
from rlwire.trainer.data.dataset import load_data
from rlwire.trainer.data.rewards import load_reward
from rlwire.trainer.errors import RunError
from rlwire.trainer.rollout import Example

HUB_ID = "Qwen/Qwen2-7B-Instruct"  # the example's model.path, kept as written
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# verl's examples/grpo_trainer/run_qwen2-7b.sh, key for key; SIZES below replace its sizes
# and PATHS its paths. The one other change: rollout.name=vllm -> hf (no vLLM on CPUs).
VERL_EXAMPLE = shlex.split(  # as the shell hands them over (its quotes removed)
    """
algorithm.adv_estimator=grpo
data.train_files=$HOME/data/gsm8k/train.parquet
data.val_files=$HOME/data/gsm8k/test.parquet
data.train_batch_size=1024
data.max_prompt_length=512
data.max_response_length=1024
data.filter_overlong_prompts=True
data.truncation='error'
actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6
actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False
trainer.critic_warmup=0
trainer.logger='["console","wandb"]'
trainer.project_name='verl_grpo_example_gsm8k'
trainer.experiment_name='qwen2_7b_function_rm'
trainer.n_gpus_per_node=8
trainer.nnodes=1
trainer.save_freq=20
trainer.test_freq=5
trainer.total_epochs=15
"""
)
SIZES = {
    "data.train_batch_size": "4",
    "data.max_response_length": "4",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "5",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "5",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "trainer.n_gpus_per_node": "2",
    "actor_rollout_ref.rollout.name": "hf",
}


def verl_example(data: Path) -> list[str]:
    """The example's overrides with this test's paths and sizes."""
    out = []
    for item in VERL_EXAMPLE:
        key, _, value = item.partition("=")
        value = SIZES.get(key, value).replace("$HOME/data/gsm8k", str(data))
        out.append(f"{key}={value}")
    return out


def _chat_model(directory: Path) -> Path:
    """A tiny Qwen2 model whose character tokenizer covers printable ASCII, with a chat
    template, and a context of 512 (the example's max_prompt_length)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = ["<pad>", "<bos>", "<eos>", "<unk>", *map(chr, range(32, 127)), "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left",
    )  # fmt: skip
    tokenizer.chat_template = TEMPLATE
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def lay_out_in_cache(home: Path, repo_id: str, folder: Path, kind: str = "models") -> None:
    """``folder`` as the Hub's cache holds a download of ``repo_id`` (``HF_HOME=home``)."""
    repo = home / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def gsm8k_rows(count: int, split: str) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = []
    for index in range(count):
        a, b = index + 2, 3 * index + 1
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {"role": "user", "content": f"Tom has {a} apples and buys {b}. {INSTRUCTION}"}
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


@pytest.fixture(scope="module")
def real_setup(tmp_path_factory):
    """An offline Hub cache holding the example's model id, and verl-format parquet data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("real")
    lay_out_in_cache(root / "hf", HUB_ID, _chat_model(root / "model"))
    data = root / "gsm8k"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(8, "train")), data / "train.parquet")
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(2, "test")), data / "test.parquet")
    return root


@pytest.fixture
def offline_hub(real_setup, monkeypatch):
    """``HF_HOME`` at the test cache and ``HF_HUB_OFFLINE=1``, in this process too (the
    library read both at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(real_setup / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(real_setup / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return real_setup


def test_verls_gsm8k_example_loads_as_written_and_says_what_changes_nothing(real_setup, caplog):
    config = load_config(overrides=verl_example(real_setup / "gsm8k"))
    assert config.actor.world_size == 2 and config.rollout.num_workers == 2  # 2 GPUs x 1 node
    assert config.hybrid_engine()  # verl's layout: one engine in every actor rank
    assert config.model.enable_gradient_checkpointing and config.model.path == HUB_ID
    assert config.actor.log_prob_micro_batch_size == 5 and config.actor.micro_batch_size == 5
    assert config.trainer.total_epochs == 15 and config.trainer.save_every == 20
    assert config.validation.every == 5 and config.algorithm.kl_coef == 0.001
    assert config.reward.function is None  # the scorer comes from each row's data_source
    notes = [r.getMessage() for r in caplog.records]
    assert (
        "actor_rollout_ref.ref.fsdp_config.param_offload=True changes nothing here: the "
        "reference policy moves with actor.offload" in notes
    )
    # the example's own sizes: tensor parallelism 2 is refused, with every other problem
    with pytest.raises(ConfigError) as err:
        load_config(
            overrides=[
                *verl_example(real_setup / "gsm8k"),
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                "critic.ppo_epochs=2",
                "trainer.stepz=3",
            ]
        )
    lines = str(err.value).splitlines()
    assert lines[0] == "3 problems in the configuration:"
    assert lines[1].strip().startswith("verl keys for features rlwire-train does not have: ")
    assert lines[2].strip().startswith("rollout.vllm.tensor_parallel_size: 2 is not allowed; ")
    assert lines[3].strip().startswith("trainer.stepz: unknown key; ")


@pytest.mark.job
def test_verls_gsm8k_example_runs_validates_and_checkpoints_at_its_frequencies(
    ray_cluster, offline_hub, tmp_path
):
    run = tmp_path / "run"
    rows, out = train_cli(run, *verl_example(offline_hub / "gsm8k"), cluster=ray_cluster)
    train = [r for r in rows if "reward_mean" in r]
    assert len(train) == 30  # 15 epochs x (8 rows // 4 prompts a batch)
    validated = [r["step"] for r in rows if "val/reward_mean" in r]
    assert validated == [5, 10, 15, 20, 25, 30]  # test_freq=5, and the last step
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == ["step_20", "step_30"]  # save_freq=20, and the last step
    assert all(0 <= r["reward_mean"] <= 1 for r in train)  # gsm8k's 0 or 1 per response
    assert "changes nothing here" in out
    assert (run / "wandb").exists()  # trainer.logger's wandb, offline


def test_rows_are_scored_by_their_data_source_and_an_unknown_one_is_refused(real_setup):
    config = load_config(overrides=verl_example(real_setup / "gsm8k"))
    model = real_setup / "model"
    rewards = load_reward(config)
    examples = load_data(config, model, needs_answer=rewards.needs_answer()).rows
    assert examples is not None and examples[0].answer == "3"
    rewards.check_rows(examples, "the data")
    right, wrong = "so 2 + 1 = 3\n#### 3", "#### 4"
    values, _ = rewards(examples[:2], [right, wrong])
    assert values.tolist() == [1.0, 0.0]  # gsm8k's scorer, chosen by 'openai/gsm8k'
    odd = [Example(prompt="p", answer="1", data_source="my/own")]
    with pytest.raises(RunError) as err:
        rewards.check_rows(odd, "data.source x.parquet")
    assert str(err.value).startswith(
        "reward.function is unset and data.source x.parquet has rows whose data_source "
        "('my/own') has no built-in scorer (the sources with a scorer: openai/gsm8k, "
    )
    plain = [Example(prompt="p", answer="1")]  # a user's own rows, without data_source
    with pytest.raises(RunError) as err:
        rewards.check_rows(plain, "data.source x.jsonl")
    assert str(err.value).startswith(
        "reward.function is unset and data.source x.jsonl has rows with no data_source (the "
    )
    assert str(err.value).endswith(
        "; set reward.function to gsm8k, math or package.module:function"
    )
    builtin = load_config(overrides=["data.source=x.parquet", "reward.function=builtin"])
    with pytest.raises(RunError, match=r"^reward.function=builtin is the built-in task's reward"):
        load_reward(builtin)


def test_a_hub_id_resolves_from_the_cache_offline_or_names_the_download(real_setup):
    script = (
        "from rlwire.trainer.models.hub import snapshot\n"
        f"print(snapshot({HUB_ID!r}, 'model.path'))\n"
        "snapshot('Qwen/Qwen2.5-0.5B-Instruct', 'model.path')\n"
    )
    env = {"HF_HOME": str(real_setup / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    found = Path(done.stdout.strip())
    assert (found / "config.json").is_file() and found.parent.name == "snapshots"
    assert (
        f"model.path: 'Qwen/Qwen2.5-0.5B-Instruct' is not in the local Hugging Face cache "
        f"({real_setup / 'hf' / 'hub'}) and HF_HUB_OFFLINE=1; download it first: hf download "
        "Qwen/Qwen2.5-0.5B-Instruct"
    ) in done.stderr


def test_a_hub_dataset_is_read_from_the_cache_with_its_subset_and_split(offline_hub, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "gsm8k-repo"
    (folder / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(6, "train")), folder / "main" / "train.parquet")
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(2, "test")), folder / "main" / "test.parquet")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n"
        "  - split: train\n    path: main/train.parquet\n"
        "  - split: test\n    path: main/test.parquet\n---\n"
    )
    lay_out_in_cache(offline_hub / "hf", "my-org/gsm8k-verl", folder, kind="datasets")
    config = load_config(
        overrides=["data.source=my-org/gsm8k-verl", "data.subset=main", "data.train_batch_size=2"]
    )
    rows = load_data(config, offline_hub / "model").rows
    assert rows is not None and [r.answer for r in rows] == [str(4 * i + 3) for i in range(6)]
    config = load_config(overrides=["data.source=my-org/gsm8k-verl", "data.subset=nope"])
    with pytest.raises(RunError, match=r"^data.source: cannot read split 'train' of 'my-org/"):
        load_data(config, offline_hub / "model")


# --- TRL's shape ----------------------------------------------------------------------------


def length_reward(completions, **kwargs):
    """TRL's signature: one float per completion, columns unused."""
    return [-abs(4 - len(c)) / 4 for c in completions]


def letter_reward(prompts, completions, completion_ids, letter, **kwargs):
    """TRL's signature with a column by name; None ("not applicable") on odd rows."""
    return [
        None if odd else float(c[:1] == want)
        for c, want, odd in zip(completions, letter, kwargs["odd"], strict=True)
    ]


def trl_rows(count: int) -> list[dict]:
    letters = "abcdefghij"
    return [
        {"prompt": f"{letters[i % 10]}:", "letter": letters[i % 10], "odd": bool(i % 2)}
        for i in range(count)
    ]


def test_trl_signatures_are_told_apart_weighted_and_checked_before_anything_starts():
    from rlwire.trainer.api import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(
        model="tiny",
        reward_funcs=[length_reward, letter_reward],
        train_dataset=trl_rows(8),
        args=GRPOConfig(
            output_dir="runs/x",
            learning_rate=3e-3,
            num_generations=4,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            max_completion_length=6,
            max_steps=3,
            reward_weights=[0.5, 2.0],
            lr_scheduler_type="constant",
            warmup_steps=2,
        ),
    )
    config = trainer.config
    assert config.data.train_batch_size == 2 and config.actor.micro_batch_size == 8
    assert config.rollout.n == 4 and config.trainer.steps == 3
    assert config.actor.optim.lr_warmup_steps == 2 and config.reward.weights == [0.5, 2.0]
    rewards = load_reward(config, trainer.reward_funcs)
    assert [r.kind for r in rewards.rewards] == ["trl", "trl"]
    assert not rewards.needs_answer()
    examples = load_data(config, Path("unused"), rows=trainer.train_rows, needs_answer=False).rows
    assert examples is not None
    values, extras = rewards(examples[:2], ["aaaa", "bb"], lambda: [[4, 4, 4, 4], [5, 5]])
    # row 0: 0.5 x 0 + 2 x 1 (its letter 'a'); row 1 is odd: letter_reward says None
    assert values.tolist() == [2.0, 0.5 * -0.5]
    assert extras["length_reward"].tolist() == [0.0, -0.5]
    assert extras["letter_reward"][0] == 1.0 and math.isnan(extras["letter_reward"][1])

    def needs_a_column(completions, solution):
        return [0.0] * len(completions)

    plain = load_config(overrides=["data.source=rows.jsonl"])
    with pytest.raises(RunError) as err:
        load_reward(plain, [needs_a_column]).check_rows(examples, "the data")
    assert str(err.value) == (
        "reward.function 'needs_a_column' takes 'solution', which no column of the data fills "
        "(its columns: letter, odd); give it a default or a **kwargs"
    )
    with pytest.raises(RunError, match=r"fit none of the reward signatures: verl's compute_"):
        load_reward(plain, [lambda x: x])
    with pytest.raises(ConfigError, match=r"^GRPOConfig: use_liger_kernel not taken here; "):
        GRPOConfig(use_liger_kernel=True)
    with pytest.raises(ConfigError, match=r"^GRPOConfig.learning_rate: 'fast' is not allowed; "):
        GRPOTrainer(model="tiny", reward_funcs=length_reward, args=GRPOConfig(learning_rate="fast"))


@pytest.mark.floor
def test_grpo_trainer_trains_a_datasets_dataset_with_trl_rewards(ray_cluster, tmp_path):
    import datasets

    from rlwire.trainer import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        learning_rate=3e-3,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=6,
        max_steps=4,
        reward_weights=[0.5, 2.0],
        warmup_steps=2,
        lr_scheduler_type="linear",
        save_steps=2,  # TRL's: a checkpoint and a model every 2 steps
        # in file order: every batch holds rows letter_reward scores (not all None)
        overrides=[f"ray.address={ray_cluster}", "ray.startup_timeout=300", "data.shuffle=false"],
    )
    trainer = GRPOTrainer(
        model="tiny",
        reward_funcs=[length_reward, letter_reward],
        train_dataset=datasets.Dataset.from_list(trl_rows(16)),
        args=args,
    )
    result = trainer.train(progress=False)
    rows = metrics(result.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # warm-up over 2 steps from 0, then linear decay to 0 at step 4 (transformers')
    assert [r["lr_scale"] for r in rows] == pytest.approx([0.0, 0.5, 1.0, 0.5])
    assert all(
        "reward_extra/length_reward" in r and "reward_extra/letter_reward" in r for r in rows
    )
    for r in rows:  # the weighted sum of the two functions' means
        length, letter = r["reward_extra/length_reward"], r["reward_extra/letter_reward"]
        assert -1.5 <= length <= 0 and 0 <= letter <= 1
    models = sorted(p.name for p in (result.run_dir / "hf_models").iterdir())
    assert models == ["step_2", "step_4"]  # written during the run, as TRL's checkpoint-N
    trainer.save_model(str(tmp_path / "saved"))  # TRL's: the model, loadable by transformers
    saved = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert "config.json" in saved and "model.safetensors" in saved


def test_trls_bf16_at_its_learning_rate_trains_the_float32_master_weights(ray_cluster, tmp_path):
    """GRPOConfig(bf16=True) at TRL's learning rate, 2 steps, then save_model: bf16 compute over
    float32 master weights, which save_model writes, nearly all changed (when bf16 meant
    bf16 parameters, 0.50% of SmolLM2's changed: most updates rounded away)."""
    from rlwire.trainer import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        bf16=True,
        learning_rate=1e-6,
        max_steps=2,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=6,
        overrides=[f"ray.address={ray_cluster}", "ray.startup_timeout=300"],
    )
    assert args.given["bf16"] is True
    trainer = GRPOTrainer(
        model="tiny",
        reward_funcs=[length_reward, letter_reward],
        train_dataset=trl_rows(16),
        args=args,
    )
    result = trainer.train(progress=False)
    trainer.save_model(str(tmp_path / "saved"))
    [initial] = result.run_dir.glob("tiny-model-seed*")
    before = _state(initial)
    after = _state(tmp_path / "saved")
    assert all(v.dtype == torch.float32 for v in after.values())
    changed = sum(int((after[n] != v).sum()) for n, v in before.items())
    assert changed / sum(v.numel() for v in before.values()) > 0.9


def _state(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype="auto").state_dict()


# --- what a real model needs ----------------------------------------------------------------


def test_gradient_checkpointing_recomputes_the_layers_and_gives_the_same_gradients(real_setup):
    from rlwire.trainer.models.modeling import load_hf_model, set_gradient_checkpointing

    ids = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    grads, calls = [], []
    for on in (False, True):
        model = load_hf_model(str(real_setup / "model"), "float32", torch.device("cpu"))
        set_gradient_checkpointing(model, on)
        model.train()
        count = [0]
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad for p in model.parameters()])
        calls.append(count[0])
    assert calls == [2, 4]  # each of the 2 layers run again in the backward pass
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed, plain, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
def test_the_learning_rate_schedule_is_transformers_and_verls(kind):
    import transformers

    from rlwire.trainer.actor.config import OptimConfig

    optim = OptimConfig(lr_scheduler_type=kind, lr_warmup_steps_ratio=0.3)
    total, warmup = 10, 3
    assert optim.warmup_steps(total) == warmup
    parameter = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([parameter], lr=1.0)
    if kind == "constant":
        theirs = transformers.get_constant_schedule_with_warmup(sgd, warmup)
    else:
        make = getattr(transformers, f"get_{kind}_schedule_with_warmup")
        theirs = make(sgd, warmup, total)
    expected = []
    for _ in range(total):
        expected.append(sgd.param_groups[0]["lr"])
        sgd.step()
        theirs.step()
    ours = [optim.schedule(step, total) for step in range(total)]
    assert ours == pytest.approx(expected, abs=1e-12)
    assert ours[0] == 0.0 and ours[warmup] == 1.0


def test_the_real_model_preset_and_the_warnings_for_the_toys_settings(monkeypatch):
    from rlwire.trainer.driver import real_model_warnings

    preset = load_config(preset="qwen2.5-0.5b")
    assert (preset.model.path, preset.model.dtype) == ("Qwen/Qwen2.5-0.5B-Instruct", "bfloat16")
    assert preset.actor.optim.lr == 1e-6 and preset.actor.optim.lr_warmup_steps == 10
    assert preset.mini_batch_rows() == 32 * 5 and preset.rollout.backend == "vllm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert real_model_warnings(preset) == []
    assert real_model_warnings(load_config()) == []  # the tiny model: its own defaults
    toy = load_config(overrides=["model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    assert real_model_warnings(toy) == [
        "model.dtype=float32 on a GPU doubles the memory and time of bfloat16; real models "
        "train in model.dtype=bfloat16 (bf16 compute over float32 master weights)",
    ]


def test_a_real_model_takes_trls_lengths_and_learning_settings_where_left_out(caplog, tmp_path):
    from rlwire.trainer.api import TRL_DEFAULTS, TRL_KEYS
    from rlwire.trainer.config.root import REAL_MODEL_DEFAULTS

    for name, (key, convert) in TRL_KEYS.items():  # one set of values: TRL's
        if key in REAL_MODEL_DEFAULTS:
            assert convert(TRL_DEFAULTS[name]) == REAL_MODEL_DEFAULTS[key], name
    tiny = load_config()
    assert (tiny.rollout.max_new_tokens, tiny.actor.optim.lr) == (8, 3e-3)  # the toy's
    with caplog.at_level("WARNING", logger="rlwire.trainer"):
        real = load_config(overrides=["model.path=org/model", "rollout.n=4"])
    assert (real.rollout.max_new_tokens, real.actor.optim.lr, real.rollout.n) == (256, 1e-6, 4)
    assert real.actor.optim.lr_scheduler_type == "linear"
    assert [r.getMessage() for r in caplog.records] == [
        "model.path=org/model is not the tiny model: rollout.max_new_tokens=256 "
        "actor.optim.lr=1e-06 actor.optim.lr_scheduler_type=linear (TRL's defaults) for the "
        "keys left out"
    ]
    # over a built-in task's own settings (tuned for the tiny model), under the run's keys
    task = load_config(overrides=["model.path=org/model", "data.source=builtin:count"])
    assert task.rollout.max_new_tokens == 256
    from rlwire.trainer.models.tiny import build_tiny_model

    built = build_tiny_model(tmp_path / "tiny")  # the toy in a folder keeps the toy's defaults
    assert load_config(overrides=[f"model.path={built}"]).rollout.max_new_tokens == 8
    verl = load_config(
        overrides=["actor_rollout_ref.model.path=org/m", "data.max_response_length=64"]
    )
    assert (verl.rollout.max_new_tokens, verl.actor.optim.lr) == (64, 1e-6)


# --- the examples ---------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def examples_importable(monkeypatch):
    """The repository's ``examples`` importable, as from its root (``python -m examples...``)."""
    monkeypatch.syspath_prepend(str(REPO))


def test_the_gsm8k_recipe_writes_verls_rows_and_its_config_is_the_presets(examples_importable):
    from examples.gsm8k.prepare import INSTRUCTION as ASKED
    from examples.gsm8k.prepare import verl_row

    row = {"question": "How many?", "answer": "3 + 4 = 7 and 1,000 more\n#### 1,007"}
    assert verl_row(row, "train", 3) == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"How many? {ASKED}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1007"},
        "extra_info": {"split": "train", "index": 3, "question": "How many?"},
    }
    with pytest.raises(ValueError, match=r"^test row 0: the answer has no '#### <number>'"):
        verl_row({"question": "q", "answer": "7"}, "test", 0)
    recipe = load_config(REPO / "examples" / "gsm8k" / "qwen2.5-0.5b.yaml")
    preset = load_config(preset="qwen2.5-0.5b")
    for section in ("model", "actor", "algorithm", "rollout"):
        assert getattr(recipe, section) == getattr(preset, section), section
    assert recipe.data.train_batch_size == preset.data.train_batch_size


def test_the_trl_style_example_script_builds_its_job_and_scores_its_dataset(examples_importable):
    """The script's trainer (its training itself is the GRPOTrainer job above): the config
    its TRL names give, and its two TRL rewards over its own dataset's rows."""
    from examples.trl_grpo import build_trainer, parse

    trainer = build_trainer(parse(["--steps", "3", "--output-dir", "runs/x"]))
    config = trainer.config
    assert (config.data.train_batch_size, config.rollout.n, config.trainer.steps) == (8, 8, 3)
    assert config.reward.weights == [1.0, 0.5] and config.model.path == "tiny"
    rewards = load_reward(config, trainer.reward_funcs)
    rows = trainer.train_rows
    examples = load_data(config, Path("unused"), rows=rows, needs_answer=False).rows
    assert examples is not None and len(examples) == 256
    want = rows[0]["letter"] * rows[0]["count"]
    values, extras = rewards(examples[:2], [want, "zzzzzzzzzz"], lambda: [[], []])
    assert values.tolist() == pytest.approx([1.0, 0.5 * -0.1])  # right; wrong and 2 too long
    assert extras["repeats"].tolist() == [1.0, 0.0]
