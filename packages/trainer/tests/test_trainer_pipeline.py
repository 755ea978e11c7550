"""The data pipeline: the source resolved once into one value, the one seed rule, one path
from rows to examples for training and validation, and the object the driver builds."""

from __future__ import annotations

import json
import pickle

import pytest

from rlwire.trainer.config.root import load_config
from rlwire.trainer.data.dataset import epoch_order, load_data
from rlwire.trainer.data.examples import VALIDATION_STEP, RowRules, task_seed
from rlwire.trainer.data.pipeline import build_pipeline
from rlwire.trainer.data.sources import resolve_source
from rlwire.trainer.data.tasks import BUILTIN_TASKS
from rlwire.trainer.errors import RunError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from rlwire.trainer.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_source_is_resolved_into_exactly_one_kind(tmp_path):
    task = resolve_source("builtin:count", "data.source")
    assert task.task is BUILTIN_TASKS["count"] and (task.path, task.hub_id, task.rows) == (
        None,
        None,
        None,
    )
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a:", "answer": "a"}])
    found = resolve_source(str(data), "data.source")
    assert found.path == data and found.task is None and found.label == str(data)
    assert found.read(None, "train") == [("line 1", {"prompt": "a:", "answer": "a"})]
    hub = resolve_source("openai/gsm8k", "data.source")
    assert hub.hub_id == "openai/gsm8k" and hub.path is None
    given = resolve_source("ignored", "validation.source", [{"prompt": "x"}])
    assert given.label == "eval_dataset" and given.read(None, "test") == [
        ("row 1", {"prompt": "x"})
    ]
    with pytest.raises(RunError) as err:
        resolve_source(str(tmp_path / "missing"), "validation.source")
    assert str(err.value) == (
        f"validation.source: {str(tmp_path / 'missing')!r} is neither 'builtin:repeat' or "
        "'builtin:count' or 'builtin:lookup', a file, nor a Hub dataset id (org/name)"
    )


def test_the_seed_rule_keeps_validation_apart_from_every_training_batch():
    assert task_seed(3, 0) == 3_000_009 and task_seed(3, 5) == 3_000_014
    held_out = task_seed(3, VALIDATION_STEP)
    assert held_out == 3_000_008
    assert all(task_seed(3, step) != held_out for step in range(10_000))


def test_the_rules_carry_only_what_rows_need():
    config = load_config(
        overrides=[
            "data.prompt_key=question",
            "data.answer_key=solution",
            "data.max_prompt_length=40",
            "data.filter_overlong_prompts=true",
            "rollout.max_new_tokens=16",
        ]
    )
    rules = RowRules.of(config, needs_answer=False)
    assert rules == RowRules(
        prompt_key="question",
        answer_keys=("solution",),
        needs_answer=False,
        max_prompt_length=40,
        filter_overlong=True,
        max_new_tokens=16,
        engine_context=None,
    )
    assert RowRules.of(load_config()).answer_keys == ("answer", "reward_model.ground_truth")


def test_the_pipeline_builds_batches_validation_reward_and_steps_once(tmp_path, tiny_dir):
    rows = [{"prompt": f"{c}:", "answer": c} for c in "abcdefghij"]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    held = _jsonl(tmp_path / "val.jsonl", rows[:3])
    reward = tmp_path / "rw.py"
    reward.write_text("def score(prompts, responses, answers):\n    return [0.0] * len(prompts)\n")
    config = load_config(
        overrides=[
            f"data.source={train}",
            f"validation.source={held}",
            f"reward.function={reward}:score",
            "data.train_batch_size=4",
            "trainer.total_epochs=3",
            "data.shuffle=false",
        ]
    )
    data = build_pipeline(config, tiny_dir)
    assert data.source.path == train and data.steps == config.trainer.steps == 6  # 3 x 10 // 4
    assert [e.prompt for e in data.batches(2)] == ["i:", "j:", "a:", "b:"]  # on into epoch 2
    assert [e.prompt for e in data.validation] == ["a:", "b:", "c:"]
    assert data.reward.rewards[0].name == "score"
    builtin = load_config(
        overrides=["data.source=builtin:count", "validation.source=builtin:count"]
    )
    data = build_pipeline(builtin, tiny_dir)
    assert data.batches.rows is None and data.reward.rewards[0].fn is BUILTIN_TASKS["count"].reward
    drawn = BUILTIN_TASKS["count"].prompts(64, seed=task_seed(0, VALIDATION_STEP))
    assert [(e.prompt, e.answer) for e in data.validation] == drawn
    with pytest.raises(RunError, match=r"^trainer.total_epochs=1: data.source 'builtin:count'"):
        build_pipeline(
            load_config(overrides=["data.source=builtin:count", "trainer.total_epochs=1"]),
            tiny_dir,
        )


def test_rows_are_shuffled_each_epoch_from_the_seed_alone(tmp_path, tiny_dir):
    rows = [{"prompt": f"{c}:", "answer": c} for c in "abcdefghij"]
    train = _jsonl(tmp_path / "train.jsonl", rows)

    def order(seed: int, steps: range) -> list[str]:
        config = load_config(
            overrides=[f"data.source={train}", "data.train_batch_size=5", f"trainer.seed={seed}"]
        )
        batches = load_data(config, tiny_dir)
        return [e.prompt for step in steps for e in batches(step)]

    first = order(0, range(6))  # 3 epochs of 2 batches
    epochs = [first[i : i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == sorted(r["prompt"] for r in rows) for e in epochs)  # each row once
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != [r["prompt"] for r in rows]
    assert order(0, range(6)) == first  # the same seed: the same order
    assert order(1, range(6)) != first  # another seed: another
    assert order(0, range(3, 6)) == first[15:]  # a resumed run (from step 3) continues it
    assert epoch_order(10, 0)(1) == epoch_order(10, 0)(1) != epoch_order(10, 0)(2)
    # fully async ships the batches to its sample queue's process (Ray pickles them):
    from ray import cloudpickle

    shuffled = load_data(load_config(overrides=[f"data.source={train}"]), tiny_dir)
    shipped = pickle.loads(cloudpickle.dumps(shuffled))
    assert [e.prompt for e in shipped(7)] == [e.prompt for e in shuffled(7)]
    unshuffled = load_config(overrides=[f"data.source={train}", "data.shuffle=false"])
    assert [e.prompt for e in load_data(unshuffled, tiny_dir)(1)] == [
        "i:",
        "j:",
        "a:",
        "b:",
        "c:",
        "d:",
        "e:",
        "f:",
    ]


def test_several_files_are_one_data_set_and_errors_name_the_file(tmp_path, tiny_dir):
    first = _jsonl(tmp_path / "a.jsonl", [{"prompt": "a:", "answer": "a"}])
    second = _jsonl(tmp_path / "b.jsonl", [{"prompt": "b:", "answer": "b"}, {"prompt": "c:"}])
    files = f"data.train_files=[{first},{second}]"  # verl's key, as its scripts pass it
    config = load_config(overrides=[files, "data.shuffle=false", "data.train_batch_size=4"])
    assert config.data.source == [str(first), str(second)]
    with pytest.raises(RunError) as err:  # the second file's row 2 lacks its answer
        load_data(config, tiny_dir)
    assert str(err.value) == (
        f"data.source: {second} line 2 lacks 'prompt' or 'answer' or 'reward_model.ground_truth'"
    )
    _jsonl(second, [{"prompt": "b:", "answer": "b"}, {"prompt": "c:", "answer": "c"}])
    rows = load_data(config, tiny_dir)
    assert [e.prompt for e in rows(0)] == ["a:", "b:", "c:", "a:"] and rows.epoch_steps() == 0
    with pytest.raises(RunError, match=r"^data.source: a built-in task cannot be read beside"):
        resolve_source(["builtin:count", str(first)], "data.source")
    from rlwire.trainer.config.root import ConfigError

    with pytest.raises(ConfigError, match=r"^data.source: \['builtin:count', .*not allowed"):
        load_config(overrides=[f"data.source=[builtin:count,{first}]"])


def test_a_named_experiment_gets_its_own_directory():
    from rlwire.trainer.checks import ConfigError

    assert load_config().trainer.run_directory == "runs/default"
    named = load_config(overrides=["trainer.project_name=gsm8k", "trainer.experiment_name=lr1e-6"])
    assert named.trainer.run_directory == "runs/gsm8k/lr1e-6"
    given = load_config(overrides=["trainer.experiment_name=x", "trainer.output_dir=/tmp/mine"])
    assert given.trainer.run_directory == "/tmp/mine"
    with pytest.raises(ConfigError, match=r"^trainer.experiment_name: 'a/b' is not allowed; use"):
        load_config(overrides=["trainer.experiment_name=a/b"])


def test_a_resume_into_another_model_or_data_is_refused_naming_the_difference(tmp_path):
    from rlwire.trainer.outputs.checkpoint import (
        finish_checkpoint,
        read_trainer_state,
        run_identity,
        write_trainer_state,
    )

    model = tmp_path / "model"
    model.mkdir()
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a:", "answer": "a"}])
    saved = load_config(overrides=[f"model.path={model}", f"data.source={data}"])
    step = tmp_path / "step_3"
    step.mkdir()
    state = {"step": 3, "strategy": "fsdp2", "lora_rank": 0, "run": run_identity(saved)}
    write_trainer_state(step, state)
    finish_checkpoint(step, 3)
    assert read_trainer_state(step, saved)["step"] == 3
    other = load_config(overrides=[f"model.path={model}", "data.source=builtin:count"])
    with pytest.raises(RunError) as err:
        read_trainer_state(step, other)
    assert str(err.value) == (
        f"trainer.resume: {step} was written for another run: data.source {str(data)!r} (now "
        "'builtin:count'). For a new run choose another trainer.output_dir or "
        "trainer.experiment_name; to continue from it anyway, set trainer.resume_anyway=true"
    )
    anyway = load_config(overrides=["data.source=builtin:count", "trainer.resume_anyway=true"])
    assert read_trainer_state(step, anyway)["step"] == 3


@pytest.mark.parametrize(
    ("side", "kept"),
    [("left", "b" * 55 + ":"), ("right", "b" * 56), ("middle", "b" * 55 + ":")],
)
def test_an_over_long_prompt_is_cut_as_data_truncation_says(tmp_path, tiny_dir, side, kept):
    # the tiny model: 64 positions, less rollout.max_new_tokens=8, leaves 56 (one per char)
    data = _jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "a:", "answer": "a"}, {"prompt": "b" * 60 + ":", "answer": "b"}],
    )
    config = load_config(
        overrides=[f"data.source={data}", f"data.truncation={side}", "data.shuffle=false"]
    )
    prompts = [e.prompt for e in load_data(config, tiny_dir)(0)]
    assert prompts[:2] == ["a:", kept] and len(kept) == 56
    with pytest.raises(
        RunError, match=r"line 2: the prompt is 61 tokens, over the 56 .* cut them\)$"
    ):
        load_data(load_config(overrides=[f"data.source={data}"]), tiny_dir)  # verl's 'error'


def test_verls_hydra_overrides_and_interpolations_load(tmp_path):
    from rlwire.trainer.checks import ConfigError

    yaml = tmp_path / "ppo.yaml"
    yaml.write_text(
        "data:\n  max_response_length: 16\n  train_batch_size: 4\n"
        "actor_rollout_ref:\n  rollout:\n    n: 4\n"
        "trainer:\n  experiment_name: len-${data.max_response_length}\n"
    )
    config = load_config(
        yaml, ["+trainer.total_training_steps=3", "++actor_rollout_ref.actor.optim.lr=1e-6"]
    )
    assert (config.rollout.max_new_tokens, config.trainer.steps) == (16, 3)
    assert (config.actor.optim.lr, config.trainer.experiment_name) == (1e-6, "len-16")
    with pytest.raises(ConfigError) as err:
        load_config(yaml, ["trainer.project_name=${nope.key}"])
    assert str(err.value) == (
        "trainer.project_name: cannot resolve '${nope.key}': Interpolation key 'nope.key' not found"
    )
    with pytest.raises(ConfigError, match=r"^override '~trainer.seed': Hydra's ~key removes"):
        load_config(overrides=["~trainer.seed"])


def test_the_tiny_model_exists_before_a_data_file_is_read(tmp_path):
    """model.path=tiny with a data file: the driver builds the tiny model before the rows
    are measured with its tokenizer (it was left to actor rank 0, and the run stopped on
    'cannot load the tokenizer'); a built-in task still leaves it to the rank."""
    from rlwire.trainer.driver import Inputs, model_for

    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "2 + 3 =", "answer": "5"}] * 8)
    config = load_config(overrides=[f"data.source={train}", "data.max_prompt_length=4"])
    model = model_for(config, tmp_path / "run", Inputs())
    assert (model / "config.json").is_file()
    assert load_data(config, model)(0)[0].prompt == "2 + 3 ="
    builtin = model_for(load_config(), tmp_path / "builtin", Inputs())
    assert not builtin.exists()


def test_plain_prompts_to_a_model_with_a_chat_template_get_one_note(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    from rlwire.trainer.data.pipeline import build_pipeline

    chat_model = tmp_path / "chat-model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(chat_model)
    chat = [{"role": "user", "content": "b:"}]
    rows = [{"prompt": "a:", "answer": "a"}, {"prompt": chat, "answer": "b"}]
    config = load_config(
        overrides=["data.train_batch_size=2", "trainer.steps=1", "reward.function=gsm8k"]
    )
    notes = build_pipeline(config, chat_model, train_rows=rows * 2).notes
    assert notes == (
        "2 of 4 prompts are plain text and reach chat-model without its chat template; an "
        "instruct model answers prompts given as chat messages (a list of "
        '{"role": "user", "content": ...}, rendered with the template)',
    )
    assert build_pipeline(config, chat_model, train_rows=[rows[1]] * 2).notes == ()
    assert build_pipeline(config, tiny_dir, train_rows=[rows[0]] * 2).notes == ()  # no template
