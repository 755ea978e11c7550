"""A real pretrained model trained for real: SmolLM2-135M-Instruct offline (the folder of the
cache ``python -m rlwire.trainer.tools.real_model`` builds), chat prompts through its
template and BPE tokenizer, answers that end at its end-of-turn token, in each mode, with a
checkpoint, a resume, an export and LoRA. (TRL's ``bf16=True`` at its learning rate on this
model, measured by hand: 99.2% of the saved weights changed in 2 steps, against 0.50% when
bf16 meant bf16 parameters; bf16 matrix products on this AVX2 CPU run 6 to 180x slower than
float32's, 115 s a step, so not here: the tiny model's job in test_trainer_real_run.py.)

Marked ``real_model``: ``uv run pytest`` leaves them out (a few minutes of CPU); CI's step
"real model" builds the cache and runs ``pytest -m real_model``."""

from __future__ import annotations

import pytest
import torch
from trainer_cli import metrics, train_cli

from rlwire.trainer.config import load_config
from rlwire.trainer.data.dataset import load_data
from rlwire.trainer.tools import arithmetic, real_model

pytestmark = pytest.mark.real_model

REWARD = "reward.function=rlwire.trainer.tools.arithmetic:reward"
SMALL = (  # 2 prompts x 4 answers of at most 16 tokens a step: seconds, not minutes
    "data.train_batch_size=2",
    "rollout.n=4",
    "rollout.max_new_tokens=16",
    "actor.optim.lr=2e-5",
    REWARD,
)


@pytest.fixture(scope="module")
def smollm2():
    """The model's folder in the cache (built by CI's step before the tests: no download
    here)."""
    if not real_model.is_built():
        pytest.fail(
            f"the real model's cache {real_model.cache_home()} is not built: run "
            "`uv run python -m rlwire.trainer.tools.real_model` once (it fetches 93 MB)"
        )
    return real_model.snapshot_dir()


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    return arithmetic.write_rows(tmp_path_factory.mktemp("data") / "train.jsonl", 32, seed=0)


def _weights(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return {n: p.detach().float() for n, p in model.state_dict().items()}


def _changed(before: dict, after: dict) -> float:
    changed = sum(int((after[n] != v).sum()) for n, v in before.items())
    return changed / sum(v.numel() for v in before.values())


def test_chat_prompts_and_left_truncation_use_its_template_and_bpe_tokenizer(smollm2, train_file):
    from transformers import AutoTokenizer

    config = load_config(
        overrides=[f"data.source={train_file}", "data.max_prompt_length=12", "data.truncation=left"]
    )
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    for example in load_data(config, smollm2)(0):
        ids = tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        assert len(ids) <= 12 and example.prompt.endswith("<|im_start|>assistant\n")
    whole = load_data(load_config(overrides=[f"data.source={train_file}"]), smollm2)(0)[0]
    assert whole.prompt.startswith("<|im_start|>system\n")  # the template's own system turn
    assert "<|im_start|>user\nWhat is " in whole.prompt


def test_colocated_trains_stops_at_end_of_turn_resumes_and_exports(
    smollm2, train_file, ray_cluster, tmp_path
):
    run = tmp_path / "run"
    common = (f"model.path={smollm2}", f"data.source={train_file}", *SMALL)
    first, out = train_cli(run, *common, "trainer.steps=2", cluster=ray_cluster)
    assert [r["step"] for r in first] == [1, 2]
    assert "plain text" not in out  # chat prompts: no note
    assert min(r["response_length_min"] for r in first) < 16  # some answers ended at <|im_end|>
    trained = _weights(run / "hf_model")
    assert _changed(_weights(smollm2), trained) > 0.9
    assert next(iter(trained.values())).dtype == torch.float32

    resumed, out = train_cli(run, *common, "trainer.steps=3", cluster=ray_cluster)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]  # step 3 only, after the two
    assert "resumed from" in out.lower() or resumed[-1]["step"] == 3
    assert _changed(trained, _weights(run / "hf_model")) > 0.9


@pytest.mark.parametrize("mode", ["fully_async", "one_step_off"])
def test_each_off_policy_mode_trains_it_from_a_shuffled_file(
    smollm2, train_file, ray_cluster, tmp_path, mode
):
    """Fully async ended before its first step on this model (a shuffled file's batches
    could not be pickled for the sample queue); one-step off with LoRA: the adapter alone
    is synced and exported."""
    lora = ("actor.lora.rank=8",) if mode == "one_step_off" else ()
    run = tmp_path / mode
    records, _ = train_cli(
        run,
        f"model.path={smollm2}",
        f"data.source={train_file}",
        *SMALL,
        f"trainer.mode={mode}",
        "trainer.steps=2",
        *lora,
        cluster=ray_cluster,
    )
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["weight_sync_bytes"] > 0 for r in records if "weight_sync_bytes" in r)
    if lora:
        adapter = run / "adapter"
        assert (adapter / "adapter_config.json").is_file()
        synced = [r["weight_sync_bytes"] for r in records if r.get("weight_sync_bytes")]
        assert synced and max(synced) < 0.05 * 4 * 134_515_008  # the adapter, not the model
