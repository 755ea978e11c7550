"""The colocated GRPO job: validate inputs, start Ray, run steps, write the run directory."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import TrainerConfig, to_dict
from .grpo import group_advantages

__all__ = ["RunError", "load_data", "load_reward", "resolve_model", "run"]

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


def _init_ray(config: TrainerConfig) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Workers run this same environment; without this, Ray's `uv run` hook would
    # package and upload the working directory (run directories included).
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
    try:
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        else:
            # Every worker declares one CPU; the embedded cluster offers at least one per
            # worker (actor ranks + the rollout worker) even on a smaller machine.
            need = config.actor.world_size + 1
            cpus = config.ray.num_cpus or max(os.cpu_count() or 1, need)
            ray.init(
                num_cpus=cpus,
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


def _train(config, run_dir, model_path, batches, reward_fn, resume_from, progress) -> Path:
    import ray
    from tqdm import tqdm

    from .plot import plot_run
    from .workers import ActorWorker, RolloutWorker

    world = config.actor.world_size
    # Colocated: actor ranks and the rollout worker share the GPUs (fractions of one when
    # there are fewer GPUs than workers; NCCL still needs one GPU per actor rank).
    cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
    gpus = min(1.0, cluster_gpus / (world + 1)) if cluster_gpus else 0
    Actor = ray.remote(num_cpus=1, num_gpus=gpus)(ActorWorker)
    Rollout = ray.remote(num_cpus=1, num_gpus=gpus)(RolloutWorker)
    actors = [Actor.remote(config, model_path, r) for r in range(world)]
    rollout = Rollout.remote(config, model_path)
    try:
        master = ray.get(actors[0].address.remote(), timeout=config.ray.startup_timeout)
        ray.get(
            [*[a.setup.remote(master) for a in actors], rollout.ready.remote()],
            timeout=config.ray.startup_timeout,
        )
    except ray.exceptions.GetTimeoutError:
        raise RunError(
            f"ray: the {world} actor ranks and the rollout worker (1 CPU"
            f"{f' and {gpus:g} GPU' if gpus else ''} each) did not start within "
            f"{config.ray.startup_timeout:g} s; the cluster has {ray.cluster_resources()}"
        ) from None
    start_step = 0
    if resume_from is not None:
        start_step = ray.get([a.load.remote(str(resume_from)) for a in actors])[0]
        log.info("resumed from %s at step %d", resume_from, start_step)
    # The checkpoint engine: actor rank 0 sends, the rollout worker receives.
    metadata = ray.get(actors[0].engine_prepare.remote())
    backend = ray.get(actors[0]._engine_backend.remote())
    ray.get(
        [
            rollout.engine_init.remote(backend, 2, metadata),
            *[a.engine_init.remote(2, metadata) for a in actors],
        ]
    )

    def sync(version: int) -> dict:
        pushed = [a.push_weights.remote(version) for a in actors]
        pulled = rollout.pull_weights.remote()
        stats = ray.get(pushed)[0]
        ray.get(pulled)
        return stats

    sync(start_step)  # the rollout worker starts from the actor's (maybe resumed) weights
    metrics_path = run_dir / "metrics.jsonl"
    if start_step == 0 and metrics_path.exists():
        metrics_path.unlink()
    n = config.rollout.n
    steps = range(start_step, config.trainer.steps)
    bar = tqdm(
        steps,
        initial=start_step,
        total=config.trainer.steps,
        disable=not progress,
        desc="rlwire-train",
        unit="step",
    )
    for step in bar:
        t0 = time.perf_counter()
        data = batches(step)
        prompts = [p for p, _ in data]
        answers = [a for _, a in data for _ in range(n)]
        generated = ray.get(rollout.generate.remote(prompts, config.trainer.seed * 7919 + step))
        t_rollout = time.perf_counter()
        rewards = _rewards(
            reward_fn, [p for p in prompts for _ in range(n)], generated.pop("texts"), answers
        )
        advantages = group_advantages(rewards, n, norm_by_std=config.algorithm.norm_adv_by_std)
        total = rewards.numel()
        share = total // world
        shards = [
            {
                k: v[r * share : (r + 1) * share]
                for k, v in {**generated, "advantages": advantages}.items()
            }
            for r in range(world)
        ]
        results = ray.get([a.train.remote(s) for a, s in zip(actors, shards, strict=True)])
        t_update = time.perf_counter()
        sync_stats = sync(step + 1)
        t_sync = time.perf_counter()
        tokens = int(generated["response_mask"].sum())
        record: dict[str, Any] = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "response_length": tokens / total,
            **{
                k: sum(r[k] for r in results) / world
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
            "time_rollout_s": t_rollout - t0,
            "time_update_s": t_update - t_rollout,
            "time_weight_sync_s": t_sync - t_update,
            "weight_sync_gbps": sync_stats["weight_sync_gbps"],
            "tokens_per_s": tokens / (t_sync - t0),
        }
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.info("step %d %s", step + 1, json.dumps(record))
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}")
        done = step + 1
        if (
            config.trainer.save_every and done % config.trainer.save_every == 0
        ) or done == config.trainer.steps:
            target = run_dir / "checkpoints" / f"step_{done}"
            ray.get([a.save.remote(str(target), done) for a in actors])
            (target / "COMPLETE").write_text(str(done))
    bar.close()
    plot_run(run_dir)
    return run_dir
