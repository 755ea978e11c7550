"""rlwire's backends inside verl (marked ``verl``: run by ``.ci/verl`` in an environment with
verl 0.9.1 and the rlwire wheels; deselected by default).

A plain ``import verl`` registers them; weight updates go through verl's own
``CheckpointEngineManager``, actor-side ``ActorRolloutRefWorker.update_weights`` and
rollout-side ``CheckpointEngineWorker.update_weights`` (2 actor ranks, 2 rollout ranks, one
Ray cluster), bit-exact over three versions, with and without ``rebuild_group``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.verl

HERE = Path(__file__).resolve().parent


def test_a_plain_import_of_verl_registers_the_rlwire_backends():
    pytest.importorskip("verl", reason="needs verl (see .ci/verl)")
    code = (
        "import verl\n"
        "from verl.checkpoint_engine import CheckpointEngineRegistry as R\n"
        "print(sorted(k for k in R._registry if k.startswith('rlwire_')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        sorted(f"rlwire_{b}" for b in ("gloo", "shm", "filesystem", "nccl", "cuda_ipc", "hccl"))
    )


@pytest.fixture(scope="module")
def groups():
    pytest.importorskip("verl", reason="needs verl (see .ci/verl)")
    import ray
    from omegaconf import OmegaConf
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    ray.init(
        # "local": its own cluster. Without an address, ray.init joins the one whose address
        # another process left in /tmp/ray (a test's ray.cluster_utils.Cluster, `ray start`)
        # and refuses num_cpus there.
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}},
    )
    from verl_workers import ActorWorker, RolloutWorker  # this folder: pytest puts it on sys.path

    engine = {"backend": "rlwire_gloo", "update_weights_bucket_megabytes": 1}
    config = OmegaConf.create(
        {
            "actor": {"strategy": "fsdp"},
            "rollout": {
                "checkpoint_engine": {
                    "_target_": "verl.workers.config.CheckpointEngineConfig",
                    **engine,
                }
            },
        }
    )
    actors = RayWorkerGroup(
        resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(ActorWorker), config=config, role="actor"
        ),
    )
    actors.init_model()
    rollouts = RayWorkerGroup(
        resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
        ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(RolloutWorker),
            rollout_config=RolloutConfig(
                name="vllm", checkpoint_engine=CheckpointEngineConfig(**engine)
            ),
        ),
    )
    yield actors, rollouts
    ray.shutdown()


@pytest.mark.parametrize("rebuild", [False, True], ids=["kept-group", "rebuild_group"])
@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_three_versions_through_verls_own_update_methods_bit_exact(groups, backend, rebuild):
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig
    from verl_workers import Replica, make_weights

    actors, rollouts = groups
    name = f"rlwire_{backend}"
    kwargs = {name: {"rebuild_group": rebuild, "checksum": True, "timeout": 120}}
    actors.use_backend(name, kwargs)
    rollouts.use_backend(name, kwargs)
    config = CheckpointEngineConfig(
        backend=name, update_weights_bucket_megabytes=1, engine_kwargs=kwargs
    )
    manager = CheckpointEngineManager(
        config=config, actor_wg=actors, replicas=[Replica(rollouts.workers)]
    )
    engines = []
    for step in (1, 2, 3):
        actors.set_version(step)
        metrics = manager.update_weights(global_steps=step)
        expected = make_weights(step)
        assert metrics[f"checkpoint_engine/{name}/tensors"] == len(expected)
        assert metrics[f"checkpoint_engine/{name}/bytes"] == sum(
            t.numel() * t.element_size() for t in expected.values()
        )
        assert metrics[f"checkpoint_engine/{name}/buckets"] >= 2  # lm_head spans buckets
        for received, steps in rollouts.received():  # both rollout ranks
            assert steps[-1] == step and list(received) == list(expected)
            for key, tensor in expected.items():
                assert received[key].dtype == tensor.dtype and torch.equal(received[key], tensor)
        engines.append(actors.engine_id()[0])  # actor rank 0's rlwire engine
    if rebuild:
        assert engines == [None, None, None]  # torn down after every update
    else:
        assert len(set(engines)) == 1 and engines[0] is not None  # one group, kept


def test_engine_kwargs_reach_the_rlwire_engine():
    pytest.importorskip("verl", reason="needs verl (see .ci/verl)")
    from verl.checkpoint_engine import CheckpointEngineRegistry

    # as verl builds it: bucket_size from update_weights_bucket_megabytes, then engine_kwargs
    adapter = CheckpointEngineRegistry.new(
        "rlwire_shm",
        is_master=True,
        bucket_size=2048 << 20,
        rlwire_bucket_size="3MiB",
        checksum=True,
        timeout=7,
    )
    metadata = adapter.prepare()
    engine = adapter.engine
    assert (engine.bucket_size, engine.checksum, engine.timeout) == (3 << 20, True, 7.0)
    # the group's secret rides in the metadata verl hands every rollout rank (never the store)
    _, rollout = type(adapter).build_topology(2, 3, [metadata, {}])
    assert len(metadata["secret"]) == 64
    assert [m["secret"] for m in rollout["master_metadata"]] == [metadata["secret"]] * 3
    assert engine.is_master and not adapter.rebuild_group
    engine.finalize()
    plain = CheckpointEngineRegistry.new("rlwire_gloo", is_master=False, bucket_size=1 << 20)
    assert plain.prepare() == {}  # not the master: nothing allocated before its role is known
    assert plain.engine is None
