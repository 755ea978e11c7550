"""The embedded job's locally built model, tokenizer and task."""

from __future__ import annotations

import pytest
import torch

from rlwire.trainer.models.tiny import VOCAB, build_tiny_model, repeat_prompts, repeat_reward


def test_tiny_model_is_a_real_hugging_face_directory(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "tiny")
    assert build_tiny_model(path) == path  # cached: built once
    from transformers import PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(VOCAB)
    # However transformers reads the directory, the ids are the same.
    auto = AutoTokenizer.from_pretrained(path)
    fast = PreTrainedTokenizerFast.from_pretrained(path)
    ids = fast("c:")["input_ids"]
    assert auto("c:")["input_ids"] == ids == [VOCAB.index("c"), VOCAB.index(":")]
    assert auto.decode([VOCAB.index("a")] * 3).replace(" ", "") == "aaa"
    assert fast.decode([VOCAB.index("a")] * 3).replace(" ", "") == "aaa"
    tokenizer = auto
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=4, do_sample=True, pad_token_id=tokenizer.pad_token_id
    )
    assert out.shape == (1, 6)


def test_prompts_are_deterministic_and_reward_gives_partial_credit():
    assert repeat_prompts(3, seed=1) == repeat_prompts(3, seed=1)
    prompt, answer = repeat_prompts(1, seed=0)[0]
    assert prompt == f"{answer}:"
    assert repeat_reward(["p"] * 4, ["cccc", "c a c a", "", "ab;;"], ["c", "c", "c", "a"]) == [
        1.0,
        0.5,
        0.0,
        0.25,
    ]
    with pytest.raises(ValueError):
        repeat_reward(["p"], ["c", "c"], ["c"])


def test_count_task_lengths_have_a_long_tail_and_the_reward_counts_positions():
    from rlwire.trainer.models.tiny import count_prompts, count_reward

    pairs = count_prompts(4000, seed=5)
    assert pairs == count_prompts(4000, seed=5) and pairs[:100] != count_prompts(100, seed=6)
    for prompt, answer in pairs:
        letter, count = prompt[0], int(prompt[1:-1])
        assert prompt.endswith(":") and answer == letter * count and 1 <= count <= 24
    lengths = [len(answer) for _, answer in pairs]
    assert 3.5 < sum(lengths) / len(lengths) < 4.5  # mean 4
    assert 0.02 < sum(n >= 12 for n in lengths) / len(lengths) < 0.07  # one in ~25
    responses = ["ccc", "cc", "ccccc", "cxc", "", "c c c"]
    assert count_reward(["c3:"] * 6, responses, ["ccc"] * 6) == [1.0, 2 / 3, 0.6, 2 / 3, 0.0, 1.0]


def test_the_realistic_preset_and_the_built_in_task_it_names():
    from rlwire.trainer.config.root import ConfigError, load_config
    from rlwire.trainer.data.rewards import load_reward
    from rlwire.trainer.models.tiny import count_reward

    config = load_config(overrides=["trainer.steps=7"], preset="realistic")
    assert config.data.source == "builtin:count" and config.rollout.max_new_tokens == 32
    assert config.actor.optim.lr == 5e-4 and config.trainer.output_dir == "runs/realistic"
    assert config.trainer.steps == 7  # the command line's overrides win
    assert load_reward(config).rewards[0].fn is count_reward  # unset: the task's own
    with pytest.raises(ConfigError, match=r"^--preset: 'real' is unknown; use one of"):
        load_config(preset="real")


def test_the_command_line_takes_options_among_the_overrides(capsys):
    import yaml

    from rlwire.trainer.cli import main

    argv = ["trainer.steps=10", "--preset", "realistic", "trainer.seed=1", "--print-config"]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["steps"] == 10 and printed["trainer"]["seed"] == 1
    assert printed["data"]["source"] == "builtin:count"  # the preset, under the overrides
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "realistic: data.source=builtin:count rollout.max_new_tokens=32" in shown
    assert "rlwire-train --help-config" in shown and "any order" in shown
    assert main(["--help-config"]) == 0
    reference = capsys.readouterr().out
    assert reference.startswith("### `model`") and "### `algorithm.filter_groups`" in reference


def test_the_paced_engine_samples_as_hf_and_takes_its_set_time_per_decoding_step(tmp_path):
    import time

    from rlwire.trainer.config.root import load_config
    from rlwire.trainer.rollout.hf import HFEngine
    from rlwire.trainer.rollout.paced import PacedEngine

    path = str(build_tiny_model(tmp_path / "tiny"))
    config = load_config(
        overrides=["rollout.backend=paced", "rollout.paced_step_s=0.05", "rollout.n=2"]
    )
    assert not PacedEngine.hybrid and config.hybrid_engine() is False
    paced, plain = (cls(config, path, torch.device("cpu")) for cls in (PacedEngine, HFEngine))
    began = time.perf_counter()
    out = paced.generate(["a:", "b:"], seed=3)
    waited = time.perf_counter() - began
    assert waited >= 0.05 * out.response_ids.shape[1] == 0.4  # 8 decoding steps
    same = plain.generate(["a:", "b:"], seed=3)
    assert torch.equal(out.response_ids, same.response_ids)
    assert torch.equal(out.logprobs, same.logprobs)


def test_the_modes_bench_plots_each_runs_reward_over_loop_time(tmp_path):
    import matplotlib.image

    from rlwire.trainer.outputs.plot import plot_modes

    def run(rewards: list[float], step_s: float) -> list[dict]:
        times = {"time_rollout_s": step_s / 2, "time_update_s": step_s / 2}
        return [{"reward_mean": r, "time_weight_sync_s": 0.0, **times} for r in rewards]

    curves = {
        "colocated": {0: run([0.1, 0.3, 0.5], 2.0), 1: run([0.2, 0.2], 2.0)},
        "fully_async": {0: run([0.1, 0.4, 0.6], 1.0), 1: run([0.3, 0.5], 1.0)},
    }
    # the curve drawn: loop seconds to each step's end, the moving mean so far (and its count)
    from rlwire.trainer.outputs.summary import reward_curve, time_to_target

    rows = run([0.1, 0.4, 0.6], 1.0)
    assert reward_curve(rows, window=2) == [(1.0, 0.1, 1), (2.0, 0.25, 2), (3.0, 0.5, 2)]
    assert time_to_target(rows, 0.5, window=2) == 3.0  # a full window only
    assert time_to_target(rows, 0.1, window=2) == 2.0 and time_to_target(rows, 0.6, 2) is None
    out = plot_modes(curves, tmp_path / "modes.png")
    assert out == tmp_path / "modes.png"
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (1000, 400)  # one 5x4-inch panel per seed at 100 dpi
