"""Ray: starting or joining the cluster, the GPU layout and placement (the bounded waits on
its workers: :mod:`.waits`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
from typing import Any

from ..config.root import TrainerConfig
from ..errors import RunError

Handle = Any
"""A Ray actor handle (``ray.remote(Class)`` then ``.remote(...)``). Ray types a handle as
``ActorHandle[Class] | type[Class]``, whose methods have ``.remote`` only where the class
decorates them with ``@ray.method``; the trainer's workers do not, so handles stay untyped."""

__all__ = [
    "GpuLayout",
    "Handle",
    "check_reachable",
    "engine_backend",
    "gpu_layout",
    "init_ray",
    "placement",
    "ray_environment",
    "stop_ray",
]


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast on a cluster address nothing listens at (Ray itself retries for minutes)."""
    import socket

    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise RunError(f"ray.address: cannot reach a Ray cluster at {address}: {err}") from None


def ray_environment() -> None:
    """Ray settings for the job; call before ``import ray`` (Ray reads them at import)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Workers run this same environment. Without this, a driver started by `uv run`
    # makes Ray package the working directory and re-run `uv run` in every worker, which
    # is slow, uploads run directories, and fails outright from a workspace member's folder.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray._private.ray_constants as constants

    # Ray may have been imported before us (by the caller): its constant is already read.
    env_bool = constants.env_bool  # type: ignore[attr-defined]  # imported there, not re-exported
    constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = env_bool("RAY_ENABLE_UV_RUN_RUNTIME_ENV", True)


_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_auth_before: dict[str, str | None] = {}
"""The process's Ray authentication variables before :func:`init_ray` set the embedded
cluster's own; :func:`stop_ray` puts them back."""


def _own_token() -> None:
    """Ray's token authentication (Ray >= 2.52) for the embedded cluster, under a token
    drawn for this run.

    Ray's servers (the GCS, the raylet, every worker's core-worker port) listen on every
    interface whatever address the node is given (Ray resolves loopback to the node's IP),
    and without authentication anyone who reaches one can run code in the job. With a
    token, every RPC must carry it: the workers inherit it from the environment (never a
    command line, never ``~/.ray``). Ray reads the mode when it is imported, so a process
    that imported it already re-reads its configuration here."""
    _auth_before.update({name: os.environ.get(name) for name in _AUTH_VARIABLES})
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_urlsafe(32)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _reread_auth()


def _reread_auth() -> None:
    """Ray's configuration and token cache read again from the environment (Ray's own way,
    as ``ray.init`` does when it turns token authentication on)."""
    import importlib

    raylet: Any = importlib.import_module("ray._raylet")  # untyped: Cython
    raylet.Config.initialize("")  # before the cache: Ray's own order
    raylet.AuthenticationTokenLoader.instance().reset_cache()


def _restore_auth() -> None:
    if not _auth_before:
        return
    for name, value in _auth_before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _auth_before.clear()
    _reread_auth()


def init_ray(config: TrainerConfig) -> None:
    """Join ``ray.address`` (or ``RAY_ADDRESS``), else start a cluster of the run's own on
    this machine, under token authentication (:func:`_own_token`)."""
    import ray

    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address)
    try:
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        else:
            # Every worker declares one CPU; the embedded cluster offers at least one per
            # worker (actor ranks + rollout workers) even on a smaller machine.
            need = config.actor.world_size + config.rollout.num_workers
            cpus = config.ray.num_cpus or max(os.cpu_count() or 1, need)
            # "local": a cluster of its own. Without an address, ray.init joins the cluster
            # whose address `ray start` (or ray.cluster_utils.Cluster) left in /tmp/ray, and
            # refuses num_cpus there; joining one is what ray.address= says.
            _own_token()
            ray.init(
                address="local",
                num_cpus=cpus,
                num_gpus=config.ray.num_gpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
    except Exception as err:  # ray raises ConnectionError, RuntimeError, ...
        _restore_auth()
        raise RunError(
            f"ray: cannot start or reach the cluster ({address or 'local'}): {err}"
        ) from None


def stop_ray() -> None:
    """``ray.shutdown()``, less its 1 s wait for an autoscaler monitor that ignores SIGTERM.

    The embedded cluster (``ray.init`` without an address) starts Ray's autoscaler
    monitor, which has nothing to scale here and takes a second to exit on SIGTERM before
    Ray kills it; killing it first saves that second of every run. Ray's own bookkeeping
    of the process is private: if it moved, this is a plain ``ray.shutdown()``.

    Reference cycles are collected first, while Ray is up: an object reference in one
    (a closure of the run's, an exception's traceback) collected after the shutdown, by
    Ray's own GC thread, makes Ray end the process with exit status 1 ("The core worker has
    already been shutdown"; found by hand: a fully-async ``vllm_server`` run that healed a
    worker trained every step, exported, and exited 1)."""
    import gc

    import ray

    gc.collect()

    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    processes = getattr(node, "all_processes", None)
    if node is not None and isinstance(processes, dict) and node.is_head():
        for info in processes.get("monitor", []):
            with contextlib.suppress(OSError, AttributeError):
                info.process.kill()
    ray.shutdown()
    _restore_auth()


@dataclasses.dataclass(frozen=True, slots=True)
class GpuLayout:
    """Which GPU (placement-group bundle) every actor rank and rollout worker uses."""

    actors: list[int]
    rollouts: list[int]

    def members(self, gpu: int) -> int:
        """How many processes (actor ranks and rollout workers) use ``gpu``."""
        return (self.actors + self.rollouts).count(gpu)

    def share(self, gpu: int) -> float:
        """The GPU fraction each process on ``gpu`` asks for (they split it evenly)."""
        return 1.0 / self.members(gpu)

    def rollout_share(self, worker: int) -> float:
        """The part of its GPU's rollout memory budget rollout worker ``worker`` may use
        (the rollout workers on one GPU split it evenly)."""
        return 1.0 / self.rollouts.count(self.rollouts[worker])

    @property
    def gpus(self) -> int:
        return max(self.actors + self.rollouts) + 1


def gpu_layout(world: int, workers: int, cluster_gpus: float, mode: str) -> GpuLayout | None:
    """Actor rank i on GPU i (NCCL needs one GPU per rank); rollout workers round-robin over
    the actors' GPUs when colocated, over the remaining GPUs in the off-policy modes
    (``one_step_off``, ``fully_async``) when there are any. ``None`` without GPUs.

    Raises:
        RunError: fewer GPUs than actor ranks.
    """
    if not cluster_gpus:
        return None
    gpus = int(cluster_gpus)  # a fraction of a GPU cannot hold an actor rank
    if world > gpus:
        raise RunError(
            f"actor.world_size: {world} actor ranks need {world} GPUs (NCCL: one GPU per "
            f"rank); the cluster has {cluster_gpus:g}"
        )
    if mode != "colocated" and gpus > world:  # a separate rollout pool: phases overlap
        rollouts = [world + j % (gpus - world) for j in range(workers)]
    else:
        rollouts = [j % world for j in range(workers)]
    return GpuLayout(list(range(world)), rollouts)


def engine_backend(
    name: str, layout: GpuLayout | None, *, one_host: bool, shm_bytes: int = 0
) -> str:
    """``ckpt_engine.backend``, with ``auto`` resolved by where the members are: on CPUs
    ``shm`` when every member is on one host (shared memory, zero-copy) and ``/dev/shm``
    has ``shm_bytes`` free, else ``gloo``;
    ``cuda_ipc`` when every rollout worker shares actor rank 0's GPU (processes on one
    device cannot form an NCCL group), ``nccl`` when all members have GPUs of their own,
    ``gloo`` for anything in between."""
    from rlwire.ckpt_engine import backend_for_device, registry

    if name != "auto":
        return name
    if layout is None:
        if one_host and "shm" in registry.usable() and _shm_free() >= shm_bytes:
            return "shm"
        return backend_for_device("cpu")
    master = layout.actors[0]
    if all(g == master for g in layout.rollouts):
        return "cuda_ipc"
    members = [master, *layout.rollouts]
    if len(set(members)) == len(members):
        return backend_for_device("cuda")
    return backend_for_device("cpu")


def _shm_free() -> int:
    import shutil

    return shutil.disk_usage("/dev/shm").free


def shm_bytes_needed(model_path: str, bucket_size: str | None) -> int:
    """What the ``shm`` engine may put in ``/dev/shm`` for this model: its two bucket slots
    and the zero-copy arena (the weights), counted as twice the model's files so that a
    float32 copy of a bfloat16 checkpoint fits too."""
    from pathlib import Path

    from rlwire.ckpt_engine import parse_bucket_size

    files = [*Path(model_path).glob("*.safetensors"), *Path(model_path).glob("*.bin")]
    return 2 * sum(f.stat().st_size for f in files) + 2 * parse_bucket_size(bucket_size)


def placement(layout: GpuLayout | None, timeout: float):
    """``place(kind, index) -> Ray options`` putting each worker on its GPU of ``layout``:
    one placement-group bundle per GPU (a whole GPU each, so bundles are distinct GPUs),
    each process asking for its even share of its bundle's GPU."""
    if layout is None:
        return lambda kind, index: {}
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cpus = [layout.members(g) for g in range(layout.gpus)]
    group = placement_group([{"GPU": 1, "CPU": c} for c in cpus], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RunError(
            f"ray: {layout.gpus} GPU(s) with {cpus} CPUs for the workers were not available "
            f"within {timeout:g} s; the cluster has {ray.cluster_resources()}"
        )

    def place(kind: str, index: int) -> dict[str, Any]:
        gpu = (layout.actors if kind == "actor" else layout.rollouts)[index]
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=gpu
        )
        return {"num_gpus": layout.share(gpu), "scheduling_strategy": strategy}

    return place
