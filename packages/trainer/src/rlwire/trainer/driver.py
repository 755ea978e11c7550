"""The job's entry point: validate inputs, start or join Ray, run the mode's loop, write the
run directory. Calls point one way: driver -> modes (colocated, one_step_off, fully_async)
-> job -> cluster, inputs."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .agent.config import endpoint_warnings
from .config.root import TrainerConfig, is_tiny, to_dict
from .data.inputs import reads_rows, resolve_model
from .data.pipeline import build_pipeline
from .errors import AlreadyFinished, RunError
from .modes.colocated import run_colocated
from .modes.fully_async import run_fully_async
from .modes.one_step_off import run_one_step_off
from .outputs.checkpoint import read_trainer_state
from .outputs.checkpoint_dirs import checkpoint_step, latest_checkpoint, set_aside_checkpoints
from .outputs.export import exported_step
from .outputs.loggers import open_trackers
from .outputs.plot import plot_run
from .outputs.run_lock import RunLock
from .outputs.summary import records, summarise
from .runtime.cluster import init_ray, ray_environment, stop_ray
from .runtime.job import Job

__all__ = ["AlreadyFinished", "Inputs", "RunError", "RunResult", "run"]

log = logging.getLogger("rlwire.trainer")


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    run_dir: Path
    summary: dict[str, float]
    """:func:`rlwire.trainer.outputs.summary.summarise` over the steps this call trained
    (``{"steps": 0}`` when it only exported)."""
    start_step: int = 0
    """The step this call started from (a resumed checkpoint's)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Inputs:
    """What the Python API hands the run in place of names in the config (one code path:
    the command gives none of them)."""

    train_rows: list[Mapping[str, Any]] | None = None
    """The training rows (``data.source`` is then only a label)."""
    eval_rows: list[Mapping[str, Any]] | None = None
    """The held-out rows (``validation.source`` then only a label)."""
    reward_functions: list[Callable[..., Any] | str] | None = None
    """The reward functions themselves, or names among them (``reward.function`` then only
    names them)."""


def run(config: TrainerConfig, *, progress: bool = True, inputs: Inputs = Inputs()) -> RunResult:
    """Run the job; return the run directory and a summary of the steps trained.

    Raises:
        AlreadyFinished: ``trainer.resume=auto`` found the run already at ``trainer.steps``.
        RunError: bad input, or a worker failed (one line, naming it).
    """
    ray_environment()

    run_dir = Path(config.trainer.run_directory).resolve()  # workers may run elsewhere
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)  # one live run per directory, or one line naming the other
    try:
        return _run(config, run_dir, progress, inputs)
    finally:
        lock.release()


def model_for(config: TrainerConfig, run_dir: Path, inputs: Inputs) -> Path:
    """The run's model directory, before the data is read. The tiny model is built by actor
    rank 0, which imports transformers anyway (the driver would spend ~2 s importing it, on
    the cores Ray and the workers start on), unless rows are read now: their prompts need
    its tokenizer."""
    rows_given = inputs.train_rows is not None or inputs.eval_rows is not None
    return resolve_model(config, run_dir, build=reads_rows(config, rows_given))


def _run(config: TrainerConfig, run_dir: Path, progress: bool, inputs: Inputs) -> RunResult:
    model_path = model_for(config, run_dir, inputs)
    data = build_pipeline(  # every row read and checked, the reward's signature too
        config,
        model_path,
        train_rows=inputs.train_rows,
        eval_rows=inputs.eval_rows,
        reward_functions=inputs.reward_functions,
    )
    resume = resume_point(config, run_dir)
    import yaml

    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    host = shared_host_warnings(os.getuid(), proc_statuses())  # not in run_warnings: the host's
    for warning in [*run_warnings(config), *host, *data.notes]:  # in train.log and on stderr
        log.warning("%s", warning)
        print(f"rlwire-train: warning: {warning}", file=sys.stderr)

    trackers = open_trackers(config, run_dir, to_dict(config))  # a missing package fails here
    from tqdm import tqdm

    # At once, saying what start-up waits for (the description changes with each phase).
    bar = tqdm(total=config.trainer.steps, disable=not progress, desc="starting Ray", unit="step")
    threads = torch.get_num_threads()
    torch.set_num_threads(config.ray.driver_threads)
    plotted = None
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlwire-plot")
    try:
        _phase(bar, "starting Ray")
        init_ray(config)
        _phase(bar, "starting workers")
        with _stopped_by_sigterm():
            job = Job(config, run_dir, str(model_path))
            result = _train(job, (data, resume, trackers), bar)
        log.info("plotting")
        plotted = pool.submit(plot_run, run_dir)  # while Ray's processes stop
        return result
    finally:
        torch.set_num_threads(threads)
        bar.close()
        for tracker in trackers:
            tracker.close()
        log.info("stopping Ray")  # the bar is closed: the command's own lines follow
        stop_ray()
        pool.shutdown()
        log.info("done")
        log.removeHandler(handler)
        handler.close()
        if plotted is not None:
            plotted.result()  # its error, if any


def resume_point(config: TrainerConfig, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint the run at ``run_dir`` continues from and its trainer state (None: it
    starts afresh), with the checkpoints that would stand in its way set aside
    (:func:`.outputs.checkpoint_dirs.set_aside_checkpoints`): all of them for
    ``trainer.resume=never``; for ``trainer.resume=PATH`` those after PATH's step, or all
    of them when PATH lies outside ``run_dir/checkpoints`` (another lineage: pruning would
    otherwise count them as the new run's). A checkpoint is checked before anything is
    moved: a refused resume leaves the directory as it found it.

    Raises:
        AlreadyFinished: ``trainer.resume=auto`` found the run already at ``trainer.steps``.
        RunError: the checkpoint cannot be continued from (one line, naming why).
    """
    if config.trainer.resume == "never":
        aside = set_aside_checkpoints(run_dir)
        if aside is not None:
            print(
                f"rlwire-train: trainer.resume=never: the earlier run's checkpoints are moved to "
                f"{aside}",
                file=sys.stderr,
            )
        return None
    if config.trainer.resume == "auto":
        resume_from = latest_checkpoint(run_dir)
        done = checkpoint_step(resume_from) if resume_from is not None else 0
        # Trained to the end but stopped before its export was complete: export only.
        unexported = done == config.trainer.steps and exported_step(run_dir) != done
        if done >= config.trainer.steps and not unexported:
            raise AlreadyFinished(
                f"{run_dir} already holds a finished run ({done} of trainer.steps="
                f"{config.trainer.steps}): nothing to train. To go on, raise trainer.steps; "
                "to start a new run, choose another trainer.output_dir (or trainer.resume=never "
                "to start over here: its checkpoints are moved aside)"
            )
        if resume_from is None:
            return None
        return resume_from, read_trainer_state(resume_from, config)
    resume_from = Path(config.trainer.resume).resolve()
    if not (resume_from / "COMPLETE").exists():
        raise RunError(f"trainer.resume: {resume_from} is not a complete checkpoint")
    state = read_trainer_state(resume_from, config)  # one this run can continue, or why not
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise RunError(
            f"trainer.resume: {resume_from}/trainer_state.json records no step; "
            "not a checkpoint this version wrote"
        )
    # the steps after it are a branch this run abandons: out of pruning's and auto's way
    own = resume_from.parent == (run_dir / "checkpoints").resolve()  # (a link to elsewhere)
    aside = set_aside_checkpoints(run_dir, after=step if own else None)
    if aside is not None:
        which = f"the checkpoints after step {step}" if own else "this directory's checkpoints"
        print(
            f"rlwire-train: trainer.resume={resume_from}: {which} are moved to {aside}",
            file=sys.stderr,
        )
    return resume_from, state


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM (a scheduler's or a user's ``kill``) stops the run as an error does: one line,
    the workers and Ray stopped, the checkpoints as they are. Ray's driver otherwise dies
    in its own handler with a stack dump. Installed after Ray started (its handler is then
    replaced), and only in the main thread (the only one signals reach)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number: int, _frame: Any) -> None:
        raise RunError(
            f"stopped by {signal.Signals(number).name}; the last checkpoint in the run "
            "directory is intact (resume with the same command)"
        )

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_warnings(config: TrainerConfig) -> list[str]:
    """What a run is warned about once at start, in ``train.log`` and on stderr."""
    return [
        *real_model_warnings(config),
        *cpu_bf16_warnings(config, cpu_flags()),
        *endpoint_warnings(config.agent),
    ]


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


LOGIN_UIDS = range(1000, 60000)
"""The UIDs of people's accounts (``login.defs``' UID_MIN to UID_MAX, Debian's and Fedora's
defaults): not root, system daemons (below 1000), systemd's dynamic users (61184 on) or
nobody (65534)."""

SHARED_HOST_DOC = "docs/packages/ckpt-engine-failures.md#threat-model-a-shared-host"


def proc_statuses() -> Iterator[str]:
    """The text of each process's ``/proc/<pid>/status`` (nothing where /proc is missing or
    unreadable, a process that ended meanwhile skipped)."""
    try:
        paths = list(Path("/proc").glob("[0-9]*/status"))
    except OSError:
        return
    for path in paths:
        try:
            yield path.read_text(errors="replace")  # a process's name may be any bytes
        except OSError:
            continue


def shared_host_warnings(uid: int, statuses: Iterable[str]) -> list[str]:
    """One line when processes of other people's accounts (:data:`LOGIN_UIDS`, by the real
    UID of each ``statuses`` text's ``Uid:`` line) run on this host beside ``uid``'s: they
    can reach the torch rendezvous store and the gloo or NCCL connections the run keeps on
    loopback, which carry no authentication. Never raises: a malformed entry is skipped."""
    others: set[int] = set()
    try:
        for text in statuses:
            real = _real_uid(text)
            if real is not None and real != uid and real in LOGIN_UIDS:
                others.add(real)
    except Exception:  # a start-up hint: the reader's failure keeps what it read, never raises
        pass
    if not others:
        return []
    shown = ", ".join(str(u) for u in sorted(others)[:5]) + (", ..." if len(others) > 5 else "")
    return [
        f"other users' processes run on this host (uid {shown}): a local user can reach the "
        "run's torch rendezvous store and process-group connections, which are not "
        "authenticated; "
        f"run on a host or network namespace of its own ({SHARED_HOST_DOC})"
    ]


def _real_uid(status: str) -> int | None:
    """The real UID of a ``/proc/<pid>/status`` text's ``Uid:`` line (None: no such line
    that reads as one)."""
    line = next((x for x in status.splitlines() if x.startswith("Uid:")), "")
    try:
        return int(line.split()[1])
    except (IndexError, ValueError):
        return None


def cpu_bf16_warnings(config: TrainerConfig, flags: set[str]) -> list[str]:
    """bf16 compute on a CPU without bf16 matrix instructions (AVX-512 BF16, AMX): torch's
    bf16 products there run 6 to 180x slower than float32's (measured on a 2-core AVX2
    machine: SmolLM2-135M's backward 103 s against 2.9 s)."""
    if config.model.dtype != "bfloat16" or torch.cuda.is_available() or not flags:
        return []
    if flags & {"avx512_bf16", "amx_bf16"}:
        return []
    return [
        "model.dtype=bfloat16 on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16 "
        "in /proc/cpuinfo): its bf16 matrix products run many times slower than float32's; "
        "on this CPU use model.dtype=float32 (TRL's bf16 is off on a CPU)"
    ]


def real_model_warnings(config: TrainerConfig) -> list[str]:
    """What a run of a real model (not ``tiny``) is warned about: float32 on a GPU. (The
    tiny model's lengths and learning rate are not a real model's defaults:
    :data:`rlwire.trainer.config.root.REAL_MODEL_DEFAULTS`.)"""
    if is_tiny(config.model.path):
        return []
    warnings = []
    if config.model.dtype == "float32" and torch.cuda.is_available():
        warnings.append(
            "model.dtype=float32 on a GPU doubles the memory and time of bfloat16; real models "
            "train in model.dtype=bfloat16 (bf16 compute over float32 master weights)"
        )
    return warnings


def _phase(bar, what: str) -> None:
    """A start-up or closing phase: logged (timestamps in train.log) and shown on the bar."""
    log.info("%s", what)
    bar.set_description_str(what)


def _train(job: Job, inputs, bar) -> RunResult:
    config, run_dir = job.config, job.run_dir
    _phase(bar, "loading the model, first weight sync")
    job.start(*inputs)
    bar.update(job.start_step)
    _phase(bar, "rlwire-train")
    try:
        loop = {
            "colocated": run_colocated,
            "one_step_off": run_one_step_off,
            "fully_async": run_fully_async,
        }[config.trainer.mode]
        if job.start_step < config.trainer.steps:
            loop(job, bar)
        else:  # resumed at the last step: only the export was left to do
            log.info("trained to step %d before; the export was not complete", job.start_step)
        _phase(bar, "exporting hf_model/")
        job.export_model()
    finally:
        job.close()
    trained = [r for r in records(run_dir) if r["step"] > job.start_step]
    return RunResult(run_dir, summarise(trained) if trained else {"steps": 0}, job.start_step)
