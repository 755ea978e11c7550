"""Ray: starting or joining the cluster, the GPU layout and placement, bounded waits."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..config.root import TrainerConfig
from ..errors import RunError

Handle = Any
"""A Ray actor handle (``ray.remote(Class)`` then ``.remote(...)``). Ray types a handle as
``ActorHandle[Class] | type[Class]``, whose methods have ``.remote`` only where the class
decorates them with ``@ray.method``; the trainer's workers do not, so handles stay untyped."""

__all__ = [
    "CLOSE_TIMEOUT",
    "GpuLayout",
    "Handle",
    "RolloutLost",
    "Watch",
    "cause",
    "check_reachable",
    "close_workers",
    "engine_backend",
    "first_line",
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


def init_ray(config: TrainerConfig) -> None:
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
            ray.init(
                address="local",
                num_cpus=cpus,
                num_gpus=config.ray.num_gpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
    except Exception as err:  # ray raises ConnectionError, RuntimeError, ...
        raise RunError(
            f"ray: cannot start or reach the cluster ({address or 'local'}): {err}"
        ) from None


def stop_ray() -> None:
    """``ray.shutdown()``, less its 1 s wait for an autoscaler monitor that ignores SIGTERM.

    The embedded cluster (``ray.init`` without an address) starts Ray's autoscaler
    monitor, which has nothing to scale here and takes a second to exit on SIGTERM before
    Ray kills it; killing it first saves that second of every run. Ray's own bookkeeping
    of the process is private: if it moved, this is a plain ``ray.shutdown()``."""
    import ray

    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    processes = getattr(node, "all_processes", None)
    if node is not None and isinstance(processes, dict) and node.is_head():
        for info in processes.get("monitor", []):
            with contextlib.suppress(OSError, AttributeError):
                info.process.kill()
    ray.shutdown()


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


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def cause(err: BaseException) -> BaseException:
    """A Ray task's own error (``RayTaskError.cause``), else ``err`` itself."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


# Fetching a result ray.wait reported ready only moves it to this process: seconds at most.
_READY_GET_S = 60.0


# How long a failure waits for the other calls to show a worker's death behind it.
_PEER_DEATH_S = 2.0

_INTACT = "the last checkpoint in the run directory is intact (resume with the same command)"


class RolloutLost(RunError):
    """A rollout worker's process died: the line that stops the run, unless the job
    replaces the worker (:mod:`rlwire.trainer.runtime.healing`); ``index``: the worker."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class Watch:
    """Waits on Ray futures (bounded unless ``timeout`` is None) that fail at once when one
    of them fails or a rollout worker's loop ends; ``names``: Ray actor id (hex) -> the
    worker's name in messages (``actor rank 1``); ``rollouts``: Ray actor id (hex) -> the
    index of a rollout worker, whose death is a :class:`RolloutLost`."""

    def __init__(
        self,
        loops: list,
        names: dict[str, str] | None = None,
        rollouts: dict[str, int] | None = None,
    ) -> None:
        self.loops = loops
        self.names = names or {}
        self.rollouts = rollouts or {}
        self.heal: Callable[[RolloutLost], Any] | None = None
        """Fully async: given the death of a rollout worker whose loop is watched, start
        its replacement and return the replacement's loop (or raise the death)."""

    def get(self, refs, *, timeout: float | None, what: str):
        import ray

        single = not isinstance(refs, list)
        pending = [refs] if single else list(refs)
        values = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RunError(f"{what}: no answer within {timeout:g} s")
            ready, _ = ray.wait(pending + self.loops, num_returns=1, timeout=left)
            for ref in ready:
                if ref in self.loops:
                    self.failed(ref)  # raises, or a replacement's loop takes its place
                    continue
                pending.remove(ref)
                try:  # the first failure stops the wait (its peers would only time out)
                    values[ref] = ray.get(ref, timeout=_READY_GET_S)
                except Exception as err:
                    reason = cause(err)
                    dead = self._dead(reason) or self._peer_died(pending)
                    if dead is not None:  # a worker process died: name it
                        who, said, actor = dead
                        line = f"{what}: {who} died ({said}); {_INTACT}"
                        if actor in self.rollouts:
                            raise RolloutLost(line, self.rollouts[actor]) from None
                        raise RunError(line) from None
                    raise RunError(
                        f"{what}: {type(reason).__name__}: {first_line(reason)}"
                    ) from None
        return values[refs] if single else [values[r] for r in refs]

    def _dead(self, reason: BaseException) -> tuple[str, str, str] | None:
        """The worker ``reason`` says died, what it says, and its Ray actor id; None if it
        names none."""
        actor = getattr(reason, "actor_id", None) or ""
        who = self.names.get(actor)
        if who is None:
            return None
        return who, f"{type(reason).__name__}: {first_line(reason)}", actor

    def _peer_died(self, pending: list) -> tuple[str, str, str] | None:
        """A peer's death behind another worker's error (a collective's peer that went away:
        the survivor's connection error may arrive first): the still pending calls that
        fail within :data:`_PEER_DEATH_S` as a worker's death, the first named."""
        import ray

        if not pending:
            return None
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_PEER_DEATH_S)
        for ref in ready:
            try:
                ray.get(ref, timeout=_READY_GET_S)
            except Exception as err:
                dead = self._dead(cause(err))
                if dead is not None:
                    return dead
        return None

    def failed(self, ref) -> None:
        import ray

        worker = self.loops.index(ref)
        try:
            ray.get(ref, timeout=_READY_GET_S)  # ready: ray.wait returned it
        except Exception as err:  # the worker's own error, or Ray's ActorDiedError
            reason = cause(err)  # the worker's exception, not Ray's wrapper of it
            line = (
                f"rollout worker {worker} stopped: {type(reason).__name__}: "
                f"{first_line(reason)}; {_INTACT}"
            )
            dead = self._dead(reason)
            if dead is not None and dead[2] in self.rollouts and self.heal is not None:
                self.loops[worker] = self.heal(RolloutLost(line, worker))
                return
            raise RunError(line) from None
        raise RunError(f"rollout worker {worker} left its loop before the run ended")


CLOSE_TIMEOUT = 30.0
"""Seconds :func:`close_workers` waits, for all the workers together, for their own
``close`` (a rollout engine's threads, files and server processes: what no finalizer removes
once ``ray.kill`` ends the process) before it kills them anyway. A worker stuck in a call (a
decoding step, a collective whose peer died) holds the job's end this long at most; a dead
one not at all."""


def close_workers(
    workers: list[Handle], closes: list[tuple[str, Any]], *, timeout: float = CLOSE_TIMEOUT
) -> list[str]:
    """Wait up to ``timeout`` seconds in all for ``closes`` (``(name, ref)``: the workers'
    own ``close`` calls, made already), then end every process of ``workers`` with
    ``ray.kill``, whether its close ended or not. The lines naming each close that failed or
    did not end in time (the caller logs them)."""
    import ray

    refs = [ref for _, ref in closes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    problems = []
    for name, ref in closes:
        if ref not in ready:
            problems.append(f"{name}: its close did not end within {timeout:g} s; killed")
            continue
        try:
            ray.get(ref, timeout=_READY_GET_S)  # ready: only fetched
        except Exception as err:  # its own error, or Ray's: it had died
            reason = cause(err)
            problems.append(f"{name}: close failed: {type(reason).__name__}: {first_line(reason)}")
    for worker in workers:
        ray.kill(worker, no_restart=True)
    return problems
