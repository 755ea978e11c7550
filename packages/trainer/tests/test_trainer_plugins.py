"""Third-party engines by dotted path: an actor engine and a rollout engine from a module
outside the package, loaded by ``actor.strategy=`` and ``rollout.backend=``."""

from __future__ import annotations

import os
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from trainer_cli import train_cli  # this folder: pytest puts it on sys.path

from rlwire.trainer.config.root import ConfigError, load_config

PLUGIN = textwrap.dedent(
    """
    import os

    from rlwire.trainer.actor.fsdp import FSDP2Engine
    from rlwire.trainer.rollout.hf import HFEngine


    def count(what):  # every worker is a process of its own: count in a file
        with open(os.environ["RLWIRE_PLUGIN_COUNTS"], "a") as f:
            f.write(what + "\\n")


    class CountingActor(FSDP2Engine):
        def optimizer_step(self):
            count("actor.optimizer_step")
            return super().optimizer_step()

        def named_weights(self):
            count("actor.named_weights")
            yield from super().named_weights()


    class CountingRollout(HFEngine):
        def generate(self, prompts, seed):
            count("rollout.generate")
            return super().generate(prompts, seed)

        async def apply(self, engine):
            count("rollout.apply")
            return await super().apply(engine)

        def close(self):  # the job asks the worker to close it before killing the process
            super().close()
            count("rollout.close")


    class CorruptingRollout(HFEngine):  # holds other weights than sent from its 2nd update
        applied = 0

        async def apply(self, engine):
            version = await super().apply(engine)
            self.applied += 1
            if self.applied == 2:
                import torch

                with torch.no_grad():
                    dict(self.model.named_parameters())["model.norm.weight"].add_(1e-3)
            return version


    class NotAnEngine:  # importable, but not a RolloutEngine: the config must refuse it
        name = "not-an-engine"
    """
)


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "my_engines.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(folder))
    return folder


@pytest.mark.job  # an embedded cluster: its workers inherit PYTHONPATH
def test_third_party_engines_run_two_steps(plugin, tmp_path, monkeypatch):
    counts = tmp_path / "counts.txt"
    # The workers of the embedded cluster inherit the command's environment.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("RLWIRE_PLUGIN_COUNTS", str(counts))
    records, _ = train_cli(
        tmp_path / "run",
        "actor.strategy=my_engines:CountingActor",
        "rollout.backend=my_engines:CountingRollout",
        "trainer.steps=2",
        "ckpt_engine.digest=true",
    )
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # the third-party rollout engine holds what the actor engine sent
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]]
    assert Counter(counts.read_text().split()) == {
        "actor.optimizer_step": 2,  # one update per step
        "actor.named_weights": 4,  # the first sync, one after each step, hf_model at the end
        "rollout.apply": 3,
        "rollout.generate": 2,
        "rollout.close": 1,  # its finalizer ran: the job closed it before ray.kill
    }


@pytest.mark.job  # an embedded cluster: its workers inherit PYTHONPATH
def test_an_engine_holding_other_weights_than_sent_stops_the_run_at_that_sync(
    plugin, tmp_path, monkeypatch
):
    """``ckpt_engine.digest``: every engine's weights are compared with the actor's after
    each sync; an engine whose weights differ after its second update (the sync of version
    1, after step 1) stops the run there, naming the worker and the tensor, not at the end
    of a run trained on another policy's samples."""
    from trainer_cli import metrics, run_cli

    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])
    )
    run = tmp_path / "run"
    code, out = run_cli(
        run, "rollout.backend=my_engines:CorruptingRollout", "trainer.steps=3",
        "ckpt_engine.digest=true",
    )  # fmt: skip
    assert code == 2, out[-4000:]
    assert (
        "ckpt_engine.digest: after the sync of weight version 1, rollout worker 0's engine "
        "holds other weights than the actor sent"
    ) in out, out[-4000:]
    assert "first differing tensor: model.norm.weight)" in out, out[-4000:]
    # step 1's record is written after its sync: none was
    assert not (run / "metrics.jsonl").exists() or metrics(run) == []


def test_bad_dotted_paths_are_refused_when_the_config_loads(plugin):
    with pytest.raises(ConfigError, match=r"^actor.strategy: cannot load 'my_engines:Nope': "):
        load_config(overrides=["actor.strategy=my_engines:Nope"])
    with pytest.raises(
        ConfigError, match=r"my_engines:NotAnEngine is not a RolloutEngine subclass$"
    ):
        load_config(overrides=["rollout.backend=my_engines:NotAnEngine"])
    with pytest.raises(ConfigError, match=r"cannot load 'no_such_module:X': No module named"):
        load_config(overrides=["actor.strategy=no_such_module:X"])
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["actor.strategy=fsdp3"])
    assert str(err.value) == (
        "actor.strategy: 'fsdp3' is not allowed; use 'fsdp2', 'fsdp' or 'megatron'"
    )
