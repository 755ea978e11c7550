"""Inputs validated before anything starts: model, data (plain and verl layouts), rewards
(batch and verl per-sample signatures, the built-ins)."""

from __future__ import annotations

import pytest
import torch

from rlwire.trainer.config.root import ConfigError, load_config
from rlwire.trainer.data.dataset import load_data
from rlwire.trainer.data.inputs import resolve_model
from rlwire.trainer.data.rewards import load_reward
from rlwire.trainer.data.scorers import gsm8k_score, math_score
from rlwire.trainer.errors import RunError
from rlwire.trainer.outputs.checkpoint_dirs import latest_checkpoint, prune_checkpoints
from rlwire.trainer.rollout import Example

# A chat template for the tiny character-level tokenizer (its vocabulary has every
# printable character): "<role>: content" lines, then "assistant:" for the answer.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from rlwire.trainer.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _pairs(batch: list[Example]) -> list[tuple[str, str]]:
    return [(e.prompt, e.answer) for e in batch]


def test_missing_model_directory(tmp_path):
    config = load_config(overrides=[f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(
        RunError,
        match=r"^model.path: .*nope is not a Hugging Face model "
        r"directory \(no config.json there\)",
    ):
        resolve_model(config, tmp_path)


def test_the_tiny_model_follows_trainer_seed_in_an_old_run_directory(tmp_path):
    from safetensors.torch import load_file

    first = resolve_model(load_config(overrides=["trainer.seed=0"]), tmp_path)
    again = resolve_model(load_config(overrides=["trainer.seed=0"]), tmp_path)
    other = resolve_model(load_config(overrides=["trainer.seed=1"]), tmp_path)
    assert first == again != other and other.parent == tmp_path  # same seed: built once
    a, b = (load_file(d / "model.safetensors") for d in (first, other))
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_pruning_keeps_the_newest_complete_checkpoints_and_one_being_written(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 7):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "actor_rank0.pt").write_bytes(b"x")
        if step not in (4, 6):  # 4: a save cut off; 6: one being written now
            (root / f"step_{step}" / "COMPLETE").write_text(str(step))
    (root / "notes").mkdir()  # not a checkpoint: never touched
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_1", "step_2", "step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step_3", "step_5", "step_6"]
    assert latest_checkpoint(tmp_path) == root / "step_5"
    assert prune_checkpoints(tmp_path, keep=2) == []  # nothing more to remove
    with pytest.raises(ConfigError, match="trainer.max_checkpoints_to_keep: 0 is not allowed"):
        load_config(overrides=["trainer.max_actor_ckpt_to_keep=0"])


def test_builtin_data_is_deterministic_per_step(tiny_dir):
    batches = load_data(load_config(), tiny_dir)
    assert batches(3) == batches(3) and batches(3) != batches(4)
    assert len(batches(0)) == 8 and batches(0)[0].data_source == "builtin:repeat"


def test_jsonl_data_and_a_malformed_line_named(tmp_path, tiny_dir):
    good = tmp_path / "d.jsonl"
    good.write_text('{"prompt": "a:", "answer": "a"}\n\n{"prompt": "b:", "answer": "b"}\n')
    batches = load_data(
        load_config(
            overrides=[
                f"data.source={good}",
                "data.train_batch_size=4",
                "rollout.n=2",
                "data.shuffle=false",  # the rows in file order
            ]
        ),
        tiny_dir,
    )
    assert _pairs(batches(0)) == [("a:", "a"), ("b:", "b"), ("a:", "a"), ("b:", "b")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a:", "answer": "a"}\n{"prompt": "b:"}\n')
    with pytest.raises(
        RunError,
        match=r"bad.jsonl line 2 lacks 'prompt' or 'answer' or 'reward_model.ground_truth'$",
    ):
        load_data(load_config(overrides=[f"data.source={bad}"]), tiny_dir)
    for line, message in (
        ('{"prompt": "  ", "answer": "a"}', "line 1: 'prompt' is empty"),
        ('{"prompt": 7, "answer": "a"}', "line 1: 'prompt' is a int (7); use text or a list"),
        ('{"prompt": null, "answer": "a"}', "line 1: 'prompt' is a NoneType (None); use text"),
    ):
        odd = tmp_path / "odd.jsonl"
        odd.write_text(line + "\n")
        with pytest.raises(RunError) as err:
            load_data(load_config(overrides=[f"data.source={odd}"]), tiny_dir)
        assert str(err.value).startswith(f"data.source: {odd} {message}")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(
        '{"prompt": "a:", "answer": "a"}\n{"prompt": "caf\u00e9:", "answer": "b"}\n'.encode(
            "latin-1"
        )
    )
    with pytest.raises(RunError) as err:
        load_data(load_config(overrides=[f"data.source={latin}"]), tiny_dir)
    assert str(err.value) == (
        f"data.source: {latin} line 2 is not UTF-8 text (byte 16: b'\\xe9'); save the file as UTF-8"
    )


def _verl_rows() -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"what is {i} + 1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(3)
    ]


def test_verl_rows_render_chat_messages_and_carry_source_and_extra_info(tmp_path, tiny_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), data)
    config = load_config(
        overrides=[
            f"data.source={data}",
            "data.train_batch_size=2",
            "rollout.n=4",
            "data.shuffle=false",
        ]
    )
    with pytest.raises(RunError) as err:  # the tiny tokenizer has no chat template
        load_data(config, tiny_dir)
    assert str(err.value) == (
        f"data.source: {data} row 1: the prompt is a list of chat messages but the tokenizer "
        f"of {tiny_dir} has no chat template; use a model whose tokenizer_config.json has a "
        "'chat_template', or store the prompts as text"
    )
    chat_dir = tmp_path / "chat-model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(chat_dir)
    first = load_data(config, chat_dir)(0)[0]  # the same directory layout, with a template
    assert first == Example(
        prompt="user: what is 0 + 1?\nassistant:",
        answer="1",
        data_source="openai/gsm8k",
        extra_info={"index": 0, "split": "train"},
        messages=[{"role": "user", "content": "what is 0 + 1?"}],  # for multi-turn rollouts
        columns={  # every field but the prompt, for TRL-signature rewards
            "data_source": "openai/gsm8k",
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"index": 0, "split": "train"},
        },
    )
    # dotted keys address nested fields explicitly, too
    nested = load_config(
        overrides=[
            f"data.source={data}",
            "data.answer_key=extra_info.index",
            "data.prompt_key=ability",
            "data.shuffle=false",  # the rows in file order
        ]
    )
    assert _pairs(load_data(nested, chat_dir)(0)[:3]) == [
        ("math", "0"),
        ("math", "1"),
        ("math", "2"),
    ]


def test_reward_from_file_and_import_errors(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def score(prompts, responses, answers):\n    return [len(r) for r in responses]\n"
        "def broken(prompts, responses, answers):\n    return [1.0]\n"
    )
    examples = [Example("p", "a")] * 3
    fn = load_reward(load_config(overrides=[f"reward.function={f}:score"]))
    rewards, extra = fn(examples[:2], ["ab", ""])
    assert torch.equal(rewards, torch.tensor([2.0, 0.0])) and extra == {}
    with pytest.raises(RunError, match=r"^reward.function: cannot import 'nowhere.mod:f'"):
        load_reward(load_config(overrides=["reward.function=nowhere.mod:f"]))
    with pytest.raises(RunError, match=r"is not one of 'builtin', 'gsm8k', 'math', 'module.path"):
        load_reward(load_config(overrides=["reward.function=justaname"]))
    broken = load_reward(load_config(overrides=[f"reward.function={f}:broken"]))
    with pytest.raises(RunError, match=r"returned \(1,\) values for 3 responses"):
        broken(examples, ["x"] * 3)
    g = tmp_path / "odd_reward.py"
    g.write_text(
        "import math\n"
        "def nan(prompts, responses, answers):\n    return [1.0, math.nan, math.nan]\n"
        "def inf(prompts, responses, answers):\n    return [math.inf, 0.0, 0.0]\n"
    )
    for name, shown, count in (("nan", "nan for response 1", 2), ("inf", "inf for response 0", 1)):
        odd = load_reward(load_config(overrides=[f"reward.function={g}:{name}"]))
        with pytest.raises(RunError) as err:
            odd(examples, ["x"] * 3)
        assert str(err.value) == (
            f"reward.function '{g}:{name}' returned {shown} (prompt 'p'); rewards must be "
            f"finite numbers ({count} of 3 were not)"
        )


def test_verl_per_sample_reward_with_dict_results_through_verls_keys(tmp_path):
    f = tmp_path / "verl_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    hit = float(solution_str.strip() == ground_truth)\n"
        "    return {'score': hit, 'acc': hit, 'index': extra_info['index'], 'note': 'x'}\n"
        "def plain(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(data_source)\n"
    )
    config = load_config(overrides=[f"custom_reward_function.path={f}"])
    assert config.reward.function == f"{f}:compute_score"  # verl's default name
    reward = load_reward(config)
    assert reward.rewards[0].per_sample
    examples = [Example("q", "7", "src", {"index": i}) for i in range(4)]
    rewards, extra = reward(examples, ["7", " 7 ", "8", ""])
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert sorted(extra) == ["acc", "index"]  # numbers only, one per response
    assert extra["acc"].tolist() == [1.0, 1.0, 0.0, 0.0] and extra["index"].tolist() == [0, 1, 2, 3]
    named = load_config(
        overrides=[f"custom_reward_function.path={f}", "custom_reward_function.name=plain"]
    )
    rewards, extra = load_reward(named)(examples[:1], ["x"])
    assert rewards.tolist() == [3.0] and extra == {}


def test_builtin_gsm8k_and_math_rewards():
    assert gsm8k_score("openai/gsm8k", "so 3 + 4 = 7.\n#### 7", "7") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 1,234", "1234") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 6 then #### 8", "8") == 1.0  # the last one
    assert gsm8k_score("openai/gsm8k", "the answer is 7", "7") == 0.0  # no #### format
    pytest.importorskip("math_verify")
    assert math_score("math", "so the answer is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_score("math", "$\\boxed{\\frac{2}{4}}$", "\\frac{1}{2}") == 1.0
    assert math_score("math", "$\\boxed{3}$", "\\frac{1}{2}") == 0.0


def test_parquet_data_and_a_row_missing_a_column_named(tmp_path, tiny_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["a:", "b:"], "answer": ["a", "b"]}), good)
    batches = load_data(
        load_config(
            overrides=[
                f"data.source={good}",
                "data.prompt_key=question",
                "data.train_batch_size=2",
                "rollout.n=4",
                "data.shuffle=false",  # the rows in file order
            ]
        ),
        tiny_dir,
    )
    assert _pairs(batches(1)) == [("a:", "a"), ("b:", "b")]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["a:"], "solution": ["a"]}), bad)
    with pytest.raises(RunError, match=r"bad.parquet row 1 lacks 'question' or 'answer' or"):
        load_data(
            load_config(overrides=[f"data.source={bad}", "data.prompt_key=question"]), tiny_dir
        )
    typed = tmp_path / "typed.parquet"  # a column of the wrong type
    pq.write_table(pa.table({"question": [1, 2], "answer": ["a", "b"]}), typed)
    with pytest.raises(RunError, match=r"typed.parquet row 1: 'question' is a int \(1\); use"):
        load_data(
            load_config(overrides=[f"data.source={typed}", "data.prompt_key=question"]), tiny_dir
        )


def test_a_verl_dataset_and_reward_train_with_no_keys_set_and_the_model_is_usable(
    ray_cluster, tmp_path, tiny_dir
):
    """verl's parquet layout and per-sample reward (set through verl's keys), a model whose
    tokenizer has a chat template; the run leaves a Hugging Face directory that reloads and
    generates."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from trainer_cli import train_cli
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "chat-model"
    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), data)
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'openai/gsm8k' and extra_info['split'] == 'train'\n"
        "    hit = float(ground_truth in solution_str)\n"
        "    return {'score': hit + 0.01 * len(solution_str), 'hit': hit}\n"
    )
    run = tmp_path / "run"
    records, output = train_cli(
        run,
        f"model.path={model_dir}",
        f"data.source={data}",
        f"custom_reward_function.path={reward}",
        "trainer.steps=3",
        "trainer.logger=[console,jsonl,tensorboard,wandb]",
        cluster=ray_cluster,
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["reward_extra/hit"] <= 1.0 and r["reward_mean"] > 0
        assert f"step {r['step']}: reward_mean={r['reward_mean']:.4g}" in output  # console
    # tensorboard: every step's reward as a scalar
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = events.Scalars("reward_extra/hit")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [e.value for e in logged] == pytest.approx([r["reward_extra/hit"] for r in records])
    # wandb: offline (no API key here), a run in the run directory
    assert len(list((run / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    final = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    saved = AutoTokenizer.from_pretrained(run / "hf_model")
    assert saved.chat_template == TEMPLATE
    prompt = saved.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = saved(prompt, return_tensors="pt", add_special_tokens=False)
    out = final.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=saved.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
    # the trained weights, not the initial ones
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in final.state_dict().items())
