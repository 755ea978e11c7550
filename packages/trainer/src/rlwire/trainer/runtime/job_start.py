"""Starting a job: the model in every worker, a resumed checkpoint, the checkpoint engine's
group. The start-up half of :class:`~rlwire.trainer.runtime.job.Job`, which mixes it in."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..algorithms.reward_kl import KLController
from ..config.root import TrainerConfig
from ..data.pipeline import DataPipeline
from ..errors import RunError
from ..outputs.checkpoint import load_checkpoint
from ..outputs.loggers import Tracker
from ..outputs.summary import drop_metrics_after
from .cluster import GpuLayout, Handle, shm_bytes_needed
from .senders import SendPlan, send_plan
from .waits import RolloutLost, Watch, cause, first_line

if TYPE_CHECKING:
    from .healing import Fleet

__all__ = ["JobStart"]

log = logging.getLogger("rlwire.trainer")


class JobStart:
    """:meth:`start`, once the workers exist (``Job.__init__`` sets ``config``, ``run_dir``,
    ``model_path``, ``world``, ``hybrid``, ``layout``, ``actors``, ``rollouts``,
    ``processes``)."""

    config: TrainerConfig
    run_dir: Path
    model_path: str
    world: int
    hybrid: bool
    layout: GpuLayout | None
    actors: list[Handle]
    rollouts: list[Handle]
    processes: list[Handle]
    fleet: Fleet
    setup_lost: Callable[[RolloutLost], Any]
    """Replaces a rollout worker that died while the weight group formed (Job sets the
    fleet's ``replace``; fully async its own, which also hands the replacement's loop the
    queue)."""
    _setup_calls: list  # the last checkpoint-engine setup's calls (a failed one settles)

    def settle(self, refs: list, lost: RolloutLost) -> None: ...  # Job's

    def abort_push(self, lost: RolloutLost) -> None: ...  # Job's

    def start(self, data: DataPipeline, resume, trackers: list[Tracker]) -> None:
        """Load the model in every worker (``model_path`` exists now), keep ``data`` (the
        batches, the reward and the held-out examples the modes read), resume if ``resume``
        is given (a checkpoint directory and its trainer state:
        :mod:`rlwire.trainer.outputs.checkpoint`),
        and join the checkpoint engine."""
        import ray

        config, layout, model_path = self.config, self.layout, self.model_path
        world, workers = self.world, config.rollout.num_workers
        self.trackers = trackers
        self.data = data
        gpus = f", sharing {layout.gpus} GPU(s)" if layout else ""
        try:
            if config.model.path == "tiny":  # work, not start-up: priming the lookup model
                self._build_model(config.ray.task_timeout)
            master = ray.get(self.actors[0].address.remote(), timeout=config.ray.startup_timeout)
            where = ray.get(
                [w.node.remote() for w in self.processes], timeout=config.ray.startup_timeout
            )
            # before the rollout engines: a vllm serve server starts with its engine
            self.plan = self._send_plan(layout, len({n for n, _ in where}) == 1, model_path)
            backend = self.plan.backend
            ready = [] if self.hybrid else [r.load_engine.remote(backend) for r in self.rollouts]
            if layout is not None:  # on GPUs the rollout engines measure free memory first
                ray.get(ready, timeout=config.ray.startup_timeout)
            ray.get(
                [*[a.setup.remote(master) for a in self.actors], *ready],
                timeout=config.ray.startup_timeout,
            )
        except ray.exceptions.GetTimeoutError:
            members = (
                f"{world} actor ranks (each with its rollout engine)"
                if self.hybrid
                else f"{world} actor ranks and {workers} rollout worker(s)"
            )
            raise RunError(
                f"ray: the {members} (1 CPU each"
                f"{gpus}) did not start within {config.ray.startup_timeout:g} s; the cluster "
                f"has {ray.cluster_resources()}"
            ) from None
        except ray.exceptions.RayActorError as err:
            raise RunError(f"ray: a worker failed to start: {first_line(err)}") from None
        except ray.exceptions.RayTaskError as err:  # setup raised: the engine refused the config
            raise RunError(f"actor setup failed: {first_line(cause(err))}") from None
        # Every later call to a worker: bounded, and a dead worker stops the run at once.
        names = {a._actor_id.hex(): f"actor rank {r}" for r, a in enumerate(self.actors)}
        rollouts = (
            {} if self.hybrid else {w._actor_id.hex(): i for i, w in enumerate(self.rollouts)}
        )
        names.update({actor: f"rollout worker {i}" for actor, i in rollouts.items()})
        self.watch = Watch([], names, rollouts)
        self.task_timeout = config.ray.task_timeout
        described = self.watch.get(  # what the actor engine reports once (Megatron: DDP)
            self.actors[0].describe.remote(), timeout=config.ray.startup_timeout, what="setup"
        )
        for line in described["info"]:
            log.info("%s", line)
        for warning in described["warnings"]:
            log.warning("%s", warning)
            print(f"rlwire-train: warning: {warning}", file=sys.stderr)
        self.start_step = self.next_update = 0
        self.extra_batches = 0  # generation batches beyond one per step (dynamic sampling)
        self.kl_ctrl = KLController(config.algorithm.kl_ctrl)  # beta of the KL in reward
        self.resumed: dict[str, Any] = {}  # the checkpoint's trainer_state.json
        if resume is not None:
            self._resume(*resume)
        if layout is not None:  # bundle indices, and the GPU ids Ray gave each process
            ids = self.watch.get(
                [w.gpu_ids.remote() for w in self.processes],
                timeout=config.ray.startup_timeout,
                what="setup",
            )
            log.info(
                "GPUs: actor ranks on bundles %s (Ray GPU ids %s), rollout workers on %s (%s)",
                layout.actors,
                ids[:world],
                layout.rollouts,
                ids[world:],
            )
        nodes = [node for node, _ in where]
        self.actor_pids = [pid for _, pid in where[:world]]  # (weight_sources)
        here = ray.get_runtime_context().get_node_id()  # the driver's: close() sweeps there
        self.local_pids = [pid for node, pid in where if node == here]
        names = {node: f"node {i}" for i, node in enumerate(dict.fromkeys(nodes))}
        log.info(
            "nodes: actor ranks on %s, rollout workers on %s; actor group store at %s:%d",
            [names[n] for n in nodes[:world]],
            "the actor ranks" if self.hybrid else [names[n] for n in nodes[world:]],
            *master,
        )
        self.engine_backend = backend  # (a replacement started during the setup loads for it)
        self.engine_backend = self._form_group(backend)
        log.info("%s", self.plan.describe(self.members))  # once: re-formed groups keep it
        self.metrics_path = self.run_dir / "metrics.jsonl"
        # a fresh run's lines, or the steps after the checkpoint, dropped
        drop_metrics_after(self.metrics_path, self.start_step)

    def _build_model(self, timeout: float) -> None:
        """``model.path=tiny``: actor rank 0 builds the task's tiny model (the lookup task's
        is primed: seconds to minutes, by seed), bounded by ``ray.task_timeout``."""
        import ray

        try:
            ray.get(self.actors[0].build_model.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RunError(
                f"model.path=tiny: the task's model was not built within {timeout:g} s "
                "(ray.task_timeout)"
            ) from None

    def _resume(self, checkpoint, saved: dict[str, Any]) -> None:
        """Load ``checkpoint`` on every actor rank (resharded to this world size)."""
        self.resumed, self.start_step = saved, saved["step"]
        self.next_update = self.start_step  # the learning-rate schedule goes on from it
        self.extra_batches = saved.get("extra_batches", 0)
        self.kl_ctrl = KLController(self.config.algorithm.kl_ctrl, saved.get("kl_ctrl_value"))
        load_checkpoint(self, checkpoint, saved)

    def reform_weight_group(self, members: list[int] | None = None) -> None:
        """A new checkpoint-engine group with every member joined anew (a replaced rollout
        worker among them), or only the rollout workers ``members`` (the others join at a
        later re-forming): a new master, so the next update is whole."""
        start = time.perf_counter()
        self.engine_backend = self._form_group(self.engine_backend, members)
        log.info("weight group re-formed in %.1f s", time.perf_counter() - start)

    def _form_group(self, backend: str, members: list[int] | None = None) -> str:
        """:meth:`_engine_setup`, formed again without a rollout worker that died meanwhile
        (:meth:`_lost_in_setup`); the backend."""
        while True:
            try:
                return self._engine_setup(backend, members)
            except RolloutLost as lost:
                members = self._lost_in_setup(lost, members)

    def _lost_in_setup(self, lost: RolloutLost, members: list[int] | None) -> list[int]:
        """A rollout worker died while the group formed: it is replaced as a death anywhere
        else is (``lost`` raised when the run does not heal or the worker used up its
        restarts), the setup's other calls end (aborted: each of their waits otherwise
        bounded by ``ckpt_engine.timeout``) and the group forms again without it; its
        replacement joins at a later re-forming, once its engine loaded (with no other
        member left, that is waited for now). The members to form the group with."""
        self.setup_lost(lost)
        self.abort_push(lost)  # the members' waits for the dead one end at once
        self.settle(self._setup_calls, lost)
        every = range(len(self.rollouts)) if members is None else members
        left = [i for i in every if i != lost.index and i in self.fleet.present]
        if not left:
            self.fleet.wait_loaded()
            left = self.fleet.present
        return left

    def _send_plan(self, layout, one_host: bool, model_path: str) -> SendPlan:
        """Who sends to which rollout worker over which backend (:mod:`.senders`): for the
        hybrid engine every rank to its own in-process engine over ``naive``, else
        ``ckpt_engine.per_rank`` and ``ckpt_engine.backend`` with ``auto`` resolved by where
        the workers run."""
        if self.hybrid:
            return SendPlan(
                tuple(range(self.world)), "naive", "rollout engines in the actor ranks' processes"
            )
        config = self.config
        return send_plan(
            config,
            layout,
            workers=config.rollout.num_workers,
            one_host=one_host,
            shm_bytes=shm_bytes_needed(model_path, config.ckpt_engine.bucket_size),
        )

    def _engine_setup(self, backend: str, members: list[int] | None = None) -> str:
        """Join every member to the checkpoint engine of ``backend``; the backend. Hybrid:
        each rank hands over to its own rollout engine. Otherwise one group per sending rank
        of :attr:`plan` (rank 0 alone, or every rank with rollout workers of its own), the
        k-th of its rollout workers among ``members`` (those that join, all by default)
        receiving as rank 1 + k; ranks with none take part in the gathers only."""
        config = self.config
        timeout = config.ray.startup_timeout + config.ckpt_engine.timeout
        if self.hybrid:
            log.info("checkpoint engine: naive (rollout engines in the actor ranks' processes)")
            self.watch.get(
                [a.engine_init_hybrid.remote() for a in self.actors],
                timeout=timeout,
                what="checkpoint engine setup",
            )
            return "naive"
        log.info("checkpoint engine: %s", backend)
        joining = list(range(len(self.rollouts))) if members is None else members
        self.members = joining  # the rollout workers in the groups, by rank
        groups = self.plan.groups(joining)
        self._setup_calls = [self.actors[rank].engine_prepare.remote(backend) for rank in groups]
        metadata = dict(
            zip(
                groups,
                self.watch.get(
                    self._setup_calls,
                    timeout=config.ray.startup_timeout,
                    what="checkpoint engine setup",
                ),
                strict=True,
            )
        )
        for rank, meta in metadata.items():
            if "host" in meta:  # store-controlled backends: where receivers connect
                log.info(
                    "checkpoint engine master at %s:%d (actor rank %d)",
                    meta["host"],
                    meta["port"],
                    rank,
                )
        calls = []
        for rank, workers in groups.items():
            size = 1 + len(workers)
            calls += [  # on the receive group: fully async's loop may hold the default one
                self.rollouts[i]
                .engine_init.options(concurrency_group="receive")
                .remote(backend, size, metadata[rank], rank=1 + k)
                for k, i in enumerate(workers)
            ]
        for rank, actor in enumerate(self.actors):
            size = 1 + len(groups.get(rank, []))
            calls.append(
                actor.engine_init.remote(
                    backend, size, metadata.get(rank, {}), sends=rank in groups
                )
            )
        self._setup_calls = calls
        self.watch.get(calls, timeout=timeout, what="checkpoint engine setup")
        return backend
