"""The colocated GRPO job: validate inputs, start Ray, run steps, write the run directory."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import TrainerConfig, to_dict
from .grpo import group_advantages
from .rollout import rollout_engine_class

__all__ = ["RunError", "engine_backend", "load_data", "load_reward", "resolve_model", "run"]

log = logging.getLogger("rlwire.trainer")


class RunError(RuntimeError):
    """The run cannot start or continue; the message says why (no traceback needed)."""


# --- inputs, validated before anything starts ---------------------------------------------
def resolve_model(config: TrainerConfig, run_dir: Path) -> Path:
    """The model directory: the built-in tiny model (built once) or the user's."""
    if config.model.path == "tiny":
        from .tiny import build_tiny_model

        return build_tiny_model(run_dir / "tiny-model", seed=config.trainer.seed)
    path = Path(config.model.path).resolve()
    if not (path / "config.json").is_file():
        raise RunError(
            f"model.path: {path} is not a Hugging Face model directory "
            "(no config.json there); give a local directory or 'tiny'"
        )
    return path


def load_data(config: TrainerConfig) -> Callable[[int], list[tuple[str, str]]]:
    """A function ``step -> [(prompt, answer)] * train_batch_size`` (deterministic in step)."""
    size, seed = config.data.train_batch_size, config.trainer.seed
    source = config.data.source
    if source == "builtin:repeat":
        from .tiny import repeat_prompts

        return lambda step: repeat_prompts(size, seed=seed * 1_000_003 + step)
    path = Path(source)
    if not path.is_file():
        raise RunError(f"data.source: {source!r} is neither 'builtin:repeat' nor a file")
    rows: list[tuple[str, str]] = []
    keys = (config.data.prompt_key, config.data.answer_key)
    if path.suffix == ".jsonl":
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                rows.append((str(record[keys[0]]), str(record[keys[1]])))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise RunError(
                    f"data.source: {path} line {number} is not a JSON object with "
                    f"{keys[0]!r} and {keys[1]!r}: {err}"
                ) from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise RunError(
                "data.source: reading Parquet needs pyarrow: pip install 'rlwire-trainer[parquet]'"
            ) from None
        table = pq.read_table(path).to_pylist()
        for number, record in enumerate(table, 1):
            if keys[0] not in record or keys[1] not in record:
                raise RunError(f"data.source: {path} row {number} lacks {keys[0]!r} or {keys[1]!r}")
            rows.append((str(record[keys[0]]), str(record[keys[1]])))
    else:
        raise RunError(f"data.source: {path} must be .jsonl or .parquet")
    if not rows:
        raise RunError(f"data.source: {path} holds no rows")
    order = list(range(len(rows)))

    def batch(step: int) -> list[tuple[str, str]]:
        start = step * size
        return [rows[order[(start + i) % len(rows)]] for i in range(size)]

    return batch


def load_reward(config: TrainerConfig) -> Callable[[list[str], list[str], list[str]], list]:
    spec = config.reward.function
    if spec == "builtin":
        from .tiny import repeat_reward

        return repeat_reward
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise RunError(
            f"reward.function: {spec!r} is not 'builtin', 'module.path:function' or "
            "'file.py:function'"
        )
    try:
        if target.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location("rlwire_user_reward", target)
            if module_spec is None or not Path(target).is_file():
                raise ImportError(f"no file {target}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except (ImportError, AttributeError, SyntaxError) as err:
        raise RunError(f"reward.function: cannot import {spec!r}: {err}") from None
    if not callable(fn):
        raise RunError(f"reward.function: {spec!r} is not callable")
    return fn


def _rewards(fn, prompts: list[str], texts: list[str], answers: list[str]) -> torch.Tensor:
    try:
        values = fn(prompts, texts, answers)
        rewards = torch.as_tensor([float(v) for v in values], dtype=torch.float32)
    except Exception as err:  # a user function: report it as a run error
        raise RunError(f"reward.function raised {type(err).__name__}: {err}") from None
    if rewards.shape != (len(texts),):
        raise RunError(
            f"reward.function returned {tuple(rewards.shape)} values for "
            f"{len(texts)} responses; it must return one float per response"
        )
    return rewards


# --- checkpoints --------------------------------------------------------------------------
_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / "checkpoints"
    found = []
    if root.is_dir():
        for child in root.iterdir():
            if (m := _STEP_DIR.match(child.name)) and (child / "COMPLETE").exists():
                found.append((int(m[1]), child))
    return max(found)[1] if found else None


# --- the job --------------------------------------------------------------------------------
def _check_reachable(address: str, timeout: float = 5.0) -> None:
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


def _ray_environment() -> None:
    """Ray settings for the job; call before ``import ray`` (Ray reads them at import)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Workers run this same environment. Without this, a driver started by `uv run`
    # makes Ray package the working directory and re-run `uv run` in every worker, which
    # is slow, uploads run directories, and fails outright from a workspace member's folder.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray._private.ray_constants as constants

    # Ray may have been imported before us (by the caller): its constant is already read.
    constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = constants.env_bool(
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV", True
    )


def _init_ray(config: TrainerConfig) -> None:
    import ray

    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
    try:
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        else:
            # Every worker declares one CPU; the embedded cluster offers at least one per
            # worker (actor ranks + rollout workers) even on a smaller machine.
            need = config.actor.world_size + config.rollout.num_workers
            cpus = config.ray.num_cpus or max(os.cpu_count() or 1, need)
            ray.init(
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


def run(config: TrainerConfig, *, progress: bool = True) -> Path:
    """Run the job; return the run directory. Raises :class:`RunError` for bad input."""
    _ray_environment()
    import ray

    run_dir = Path(config.trainer.output_dir).resolve()  # workers may run elsewhere
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(config, run_dir)
    batches = load_data(config)
    reward_fn = load_reward(config)
    resume_from = None
    if config.trainer.resume == "auto":
        resume_from = latest_checkpoint(run_dir)
    elif config.trainer.resume != "never":
        resume_from = Path(config.trainer.resume).resolve()
        if not (resume_from / "COMPLETE").exists():
            raise RunError(f"trainer.resume: {resume_from} is not a complete checkpoint")
    import yaml

    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    _init_ray(config)
    try:
        return _train(config, run_dir, str(model_path), batches, reward_fn, resume_from, progress)
    finally:
        log.removeHandler(handler)
        ray.shutdown()


class _Job:
    """What both modes share: the Ray workers, the metrics file, scoring, updates, saves."""

    def __init__(self, config, run_dir, model_path, batches, reward_fn, resume_from) -> None:
        import ray

        from .workers import ActorWorker, RolloutWorker

        self.config, self.run_dir = config, run_dir
        self.batches, self.reward_fn = batches, reward_fn
        world, workers = config.actor.world_size, config.rollout.num_workers
        self.world = world
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        layout = gpu_layout(world, workers, cluster_gpus, config.trainer.mode)
        # colocated on GPUs, an engine that can sleep frees its memory while the actor
        # trains (nothing to free elsewhere: no calls)
        engine = rollout_engine_class(config.rollout.backend)
        self.rollout_sleeps = engine.can_sleep and layout is not None
        self.namespace = f"rlwire-{os.getpid()}-{int(time.time())}"
        place = _placement(layout, config.ray.startup_timeout)
        Actor = ray.remote(num_cpus=1)(ActorWorker)
        Rollout = ray.remote(num_cpus=1)(RolloutWorker)
        self.actors = [
            Actor.options(**place("actor", r)).remote(config, model_path, r) for r in range(world)
        ]
        self.rollouts = [
            Rollout.options(
                name=f"rollout-{i}", namespace=self.namespace, **place("rollout", i)
            ).remote(config, model_path, i, layout.rollout_share(i) if layout else 1.0)
            for i in range(workers)
        ]
        gpus = f", sharing {layout.gpus} GPU(s)" if layout else ""
        try:
            master = ray.get(self.actors[0].address.remote(), timeout=config.ray.startup_timeout)
            ready = [r.ready.remote() for r in self.rollouts]
            if layout is not None:  # on GPUs the rollout engines measure free memory first
                ray.get(ready, timeout=config.ray.startup_timeout)
            ray.get(
                [*[a.setup.remote(master) for a in self.actors], *ready],
                timeout=config.ray.startup_timeout,
            )
        except ray.exceptions.GetTimeoutError:
            raise RunError(
                f"ray: the {world} actor ranks and {workers} rollout worker(s) (1 CPU each"
                f"{gpus}) did not start within {config.ray.startup_timeout:g} s; the cluster "
                f"has {ray.cluster_resources()}"
            ) from None
        except ray.exceptions.RayActorError as err:
            raise RunError(f"ray: a worker failed to start: {_first_line(err)}") from None
        except ray.exceptions.RayTaskError as err:  # setup raised: the engine refused the config
            raise RunError(f"actor setup failed: {_first_line(_cause(err))}") from None
        described = ray.get(
            self.actors[0].describe.remote(), timeout=config.ray.startup_timeout
        )  # what the actor engine reports once (Megatron: its DDP config and warnings)
        for line in described["info"]:
            log.info("%s", line)
        for warning in described["warnings"]:
            log.warning("%s", warning)
            print(f"rlwire-train: warning: {warning}", file=sys.stderr)
        self.start_step = 0
        if resume_from is not None:
            self.start_step = ray.get([a.load.remote(str(resume_from)) for a in self.actors])[0]
            log.info("resumed from %s at step %d", resume_from, self.start_step)
        # The checkpoint engine: actor rank 0 sends, rollout worker i receives as rank 1 + i.
        if layout is not None:  # bundle indices, and the GPU ids Ray gave each process
            ids = ray.get([w.gpu_ids.remote() for w in [*self.actors, *self.rollouts]])
            log.info(
                "GPUs: actor ranks on bundles %s (Ray GPU ids %s), rollout workers on %s (%s)",
                layout.actors,
                ids[:world],
                layout.rollouts,
                ids[world:],
            )
        backend = engine_backend(config.ckpt_engine.backend, layout)
        self.engine_backend = backend
        log.info("checkpoint engine: %s", backend)
        metadata = ray.get(self.actors[0].engine_prepare.remote(backend))
        size = 1 + workers
        ray.get(
            [
                *[r.engine_init.remote(backend, size, metadata) for r in self.rollouts],
                *[a.engine_init.remote(backend, size, metadata) for a in self.actors],
            ]
        )
        self.metrics_path = run_dir / "metrics.jsonl"
        if self.start_step == 0 and self.metrics_path.exists():
            self.metrics_path.unlink()

    def close(self) -> None:
        """End every worker process now, without interpreter finalization.

        ``ray.kill`` exits the process at once. A normal exit would finalize the
        interpreter while the process group's gloo worker threads may still be dropping
        Python references, which aborts the process ("terminate called without an active
        exception"). Everything the run produced is written by the time this is called.
        """
        import ray

        for worker in [*self.actors, *self.rollouts]:
            ray.kill(worker, no_restart=True)

    def update(self, generated: dict, prompts: list[str], answers: list[str]) -> dict[str, Any]:
        """Score, compute advantages and run one update on every actor rank (one step)."""
        import ray

        n = self.config.rollout.n
        texts = generated.pop("texts")
        rewards = _rewards(self.reward_fn, prompts, texts, answers)
        advantages = group_advantages(rewards, n, norm_by_std=self.config.algorithm.norm_adv_by_std)
        total = rewards.numel()
        share = total // self.world
        tensors = {k: v for k, v in generated.items() if isinstance(v, torch.Tensor)}
        tensors["advantages"] = advantages
        shards = [
            {k: v[r * share : (r + 1) * share] for k, v in tensors.items()}
            for r in range(self.world)
        ]
        results = ray.get([a.train.remote(s) for a, s in zip(self.actors, shards, strict=True)])
        tokens = int(generated["response_mask"].sum())
        return {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "response_length": tokens / total,
            **{
                k: sum(r[k] for r in results) / self.world
                for k in (
                    "policy_loss",
                    "clip_fraction",
                    "entropy",
                    "kl_ref",
                    "grad_norm",
                    "kl_rollout",
                )
            },
            "retained_grad_bytes": max(r["retained_grad_bytes"] for r in results),
            "grad_sync_policy": results[0]["grad_sync_policy"],
            "_tokens": tokens,
        }

    @staticmethod
    def step_record(
        step: int,
        result: dict[str, Any],
        times: tuple[float, float, float, float],
        synced: dict[str, Any],
        *,
        samples: int,
        version: int,
        lags: list[int],
    ) -> dict[str, Any]:
        """The metrics both modes record: ``times`` are the step's start, samples ready,
        update done and sync done; ``lags`` the version lag of each prompt group."""
        t0, t_samples, t_update, t_sync = times
        tokens = result.pop("_tokens")
        return {
            "step": step + 1,
            **result,
            "time_rollout_s": t_samples - t0,
            "time_update_s": t_update - t_samples,
            "time_weight_sync_s": t_sync - t_update,
            "weight_sync_gbps": synced["weight_sync_gbps"],
            "tokens_per_s": tokens / (t_sync - t0),
            "samples_per_s": samples / (t_sync - t0),
            "weight_version": version,
            "version_lag_mean": sum(lags) / len(lags),
            "version_lag_max": max(lags),
            **(_digests(synced, synced["pulls"]) if synced["pulls"] else {}),
        }

    def record(self, record: dict[str, Any], bar) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("step %d %s", record["step"], json.dumps(record))
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}")

    def save_if_due(self, done: int) -> None:
        import ray

        every, last = self.config.trainer.save_every, self.config.trainer.steps
        if (every and done % every == 0) or done == last:
            target = self.run_dir / "checkpoints" / f"step_{done}"
            ray.get([a.save.remote(str(target), done) for a in self.actors])
            (target / "COMPLETE").write_text(str(done))


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
    the actors' GPUs when colocated, over the remaining GPUs in fully-async mode when there
    are any. ``None`` without GPUs.

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
    if mode == "fully_async" and gpus > world:  # a separate rollout pool
        rollouts = [world + j % (gpus - world) for j in range(workers)]
    else:
        rollouts = [j % world for j in range(workers)]
    return GpuLayout(list(range(world)), rollouts)


def engine_backend(name: str, layout: GpuLayout | None) -> str:
    """``ckpt_engine.backend``, with ``auto`` resolved by where the members are: ``gloo``
    on CPUs, ``cuda_ipc`` when every rollout worker shares actor rank 0's GPU (processes on
    one device cannot form an NCCL group), ``nccl`` when all members have GPUs of their
    own, ``gloo`` for anything in between."""
    from rlwire.ckpt_engine import backend_for_device

    if name != "auto":
        return name
    if layout is None:
        return backend_for_device("cpu")
    master = layout.actors[0]
    if all(g == master for g in layout.rollouts):
        return "cuda_ipc"
    members = [master, *layout.rollouts]
    if len(set(members)) == len(members):
        return backend_for_device("cuda")
    return backend_for_device("cpu")


def _placement(layout: GpuLayout | None, timeout: float):
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


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _cause(err: BaseException) -> BaseException:
    """A Ray task's own error (``RayTaskError.cause``), else ``err`` itself."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


class _Watch:
    """Waits on Ray futures (bounded unless ``timeout`` is None) that fail at once when one
    of them fails or a rollout worker's loop ends."""

    def __init__(self, loops: list) -> None:
        self.loops = loops

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
                    self.failed(ref)
                pending.remove(ref)
                try:  # the first failure stops the wait (its peers would only time out)
                    values[ref] = ray.get(ref)
                except Exception as err:
                    cause = _cause(err)
                    raise RunError(
                        f"{what}: {type(cause).__name__}: {_first_line(cause)}"
                    ) from None
        return values[refs] if single else [values[r] for r in refs]

    def failed(self, ref) -> None:
        import ray

        worker = self.loops.index(ref)
        try:
            ray.get(ref)
        except Exception as err:  # the worker's own error, or Ray's ActorDiedError
            raise RunError(
                f"rollout worker {worker} stopped: {type(err).__name__}: {_first_line(err)}; "
                "the last checkpoint in the run directory is intact (resume with the same command)"
            ) from None
        raise RunError(f"rollout worker {worker} left its loop before the run ended")


def _digests(push: dict, pulls: list[dict]) -> dict[str, Any]:
    if push.get("digest") is None:
        return {}
    return {
        "weight_digest_actor": push["digest"],
        "weight_digest_rollout": [p["digest"] for p in pulls],
    }


def _train(config, run_dir, model_path, batches, reward_fn, resume_from, progress) -> Path:
    from tqdm import tqdm

    from .plot import plot_run

    job = _Job(config, run_dir, model_path, batches, reward_fn, resume_from)
    bar = tqdm(
        total=config.trainer.steps,
        initial=job.start_step,
        disable=not progress,
        desc="rlwire-train",
        unit="step",
    )
    try:
        if config.trainer.mode == "fully_async":
            from .fully_async import run_fully_async

            run_fully_async(job, bar)
        else:
            _run_colocated(job, bar)
    finally:
        bar.close()
        job.close()
    plot_run(run_dir)
    return run_dir


def _run_colocated(job: _Job, bar) -> None:
    """Generate, update, sync: every sample comes from the weights being updated."""
    import ray

    from .rollout import collate

    config = job.config
    n, workers = config.rollout.n, len(job.rollouts)
    watch = _Watch([])

    def sync(version: int) -> dict:
        if job.rollout_sleeps:
            ray.get([r.wake_up.remote() for r in job.rollouts])
        pushed = [a.push_weights.remote(version) for a in job.actors]
        pulled = [r.pull_weights.remote() for r in job.rollouts]
        # A receiver's failure ends the wait at once with its own error (the sender would
        # only report a timeout, after ckpt_engine.timeout). No overall deadline: the engine
        # bounds every wait of the transfer, and a large model may outlast any fixed budget.
        done = watch.get([*pushed, *pulled], timeout=None, what="weight sync")
        return {**done[0], "pulls": done[len(pushed) :]}

    sync(job.start_step)  # the rollout workers start from the actor's (maybe resumed) weights
    for step in range(job.start_step, config.trainer.steps):
        t0 = time.perf_counter()
        data = job.batches(step)
        prompts = [p for p, _ in data]
        share = -(-len(prompts) // workers)
        parts = ray.get(
            [
                r.generate.remote(prompts[i * share : (i + 1) * share], _seed(config, step, i))
                for i, r in enumerate(job.rollouts)
                if prompts[i * share : (i + 1) * share]
            ]
        )
        generated = collate(parts)
        if job.rollout_sleeps:  # colocated on GPUs: free the engine's memory for the update
            ray.get([r.sleep.remote() for r in job.rollouts])
        t_rollout = time.perf_counter()
        expanded = [p for p in prompts for _ in range(n)]
        result = job.update(generated, expanded, [a for _, a in data for _ in range(n)])
        t_update = time.perf_counter()
        synced = sync(step + 1)
        t_sync = time.perf_counter()
        record = job.step_record(
            step,
            result,
            (t0, t_rollout, t_update, t_sync),
            synced,
            samples=len(prompts) * n,
            version=step + 1,
            lags=[0],
        )
        job.record(record, bar)
        bar.update(1)
        job.save_if_due(step + 1)


def _seed(config: TrainerConfig, step: int, worker: int) -> int:
    return config.trainer.seed * 7919 + step + worker * 1_000_003
