"""One Ray cluster for the trainer's tests that run jobs (starting one costs 10 to 16 s here).

The cluster lives in a process of its own, not in pytest's: a job joining it runs its driver
in pytest's process (``trainer_cli.train_cli``, or the driver's ``run()``), which connects
and disconnects at the end, as any user's driver does. Each job kills its own workers when
it ends, so jobs do not see each other.

Markers: every test that runs a Ray job (it takes the ``ray_cluster`` fixture, or says
``@pytest.mark.job``) is marked ``job``. The default selection (``uv run pytest``) runs one
of them, marked ``smoke``: a run resumed bit for bit, which starts the cluster, trains on
two FSDP2 ranks, checkpoints, resumes and exports. ``floor`` marks the jobs, one per strategy
and mode, that CI runs on the floors' stack (Python 3.12 and torch 2.11, ``.ci/run`` step
5); ``-m "job and not floor"`` runs the others (step 1b). Each job costs its workers'
imports (about 5 s of CPU a process here).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from trainer_pipes import first_line  # this folder: pytest puts it on sys.path


def _preload_in_fork_server(*modules: str) -> None:
    """Add ``modules`` to what multiprocessing's fork server imports before it forks a child.

    The server is one per process (started by the first child any test asks of it) and
    imports one list, which ``set_forkserver_preload`` replaces: with each package's tests
    setting their own, the last conftest pytest loaded would decide for all. So each adds its
    modules to the list set so far and sets the union, sorted: the same list whatever the
    order, alone or in the workspace's run. A module the server cannot import (another
    package's helper off its path, an optional library missing) is skipped by the server, and
    a child imports what its server lacks: only start-up time depends on the list.
    """
    from multiprocessing import forkserver

    # What is set so far: multiprocessing has no getter. Its default, "__main__", would
    # import pytest's entry point in the server; no list here asks for it.
    current = getattr(forkserver._forkserver, "_preload_modules", [])
    multiprocessing.set_forkserver_preload(sorted((set(current) - {"__main__"}) | set(modules)))


# reshard.py forks its gloo ranks from multiprocessing's fork server, which imports torch,
# transformers, the tiny model's modeling code and the worker scripts once: a rank starts in
# milliseconds instead of the 4-5 s of CPU those imports cost a fresh interpreter (7 ranks
# for the resharding fixture).
_preload_in_fork_server(
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "megatron.core",
    "trainer_checkpoint_worker",
    "trainer_megatron_worker",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.job)


# Enough CPUs for the largest job here (2 actor ranks + 4 rollout workers, 1 CPU each:
# Ray's logical CPUs, not the machine's).
CPUS = 6
START_TIMEOUT = 120.0

_HEAD = textwrap.dedent(
    f"""
    import logging, sys
    from rlwire.trainer.runtime.cluster import ray_environment
    ray_environment()
    import ray
    context = ray.init(
        address="local",  # its own, whatever cluster another process started
        num_cpus={CPUS},
        include_dashboard=False,
        logging_level=logging.ERROR,
    )
    print(context.address_info["gcs_address"], flush=True)
    sys.stdin.read()  # until pytest closes the pipe
    ray.shutdown()
    """
)


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of a running Ray cluster shared by the session's jobs."""
    here = str(Path(__file__).resolve().parent)  # the workers import the test helpers
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    head = subprocess.Popen(
        [sys.executable, "-c", _HEAD],
        env={**os.environ, "PYTHONPATH": path},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        address = first_line(head, "the shared Ray cluster's address", timeout=START_TIMEOUT)
        yield address
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)


@pytest.fixture(scope="session")
def fsdp2_reference_run(ray_cluster, tmp_path_factory) -> Path:
    """The run directory of 3 steps of FSDP2 on 2 gloo ranks with
    :data:`trainer_cli.FSDP2_REFERENCE` (a checkpoint after every step; rollout engines in the
    ranks' processes)."""
    from trainer_cli import FSDP2_REFERENCE, train_cli

    run = tmp_path_factory.mktemp("fsdp2") / "run"
    train_cli(run, *FSDP2_REFERENCE, "trainer.steps=3", cluster=ray_cluster)
    return run


@pytest.fixture(scope="session")
def fsdp2_reference(fsdp2_reference_run) -> list[dict]:
    """The metrics of :func:`fsdp2_reference_run`."""
    from trainer_cli import metrics

    return metrics(fsdp2_reference_run)


EOS_BIAS = 3.0
"""Added to the end-of-sequence logit of :func:`lookup_core`'s model: replies of a few
tokens, then ``<eos>``."""


@pytest.fixture(scope="module")
def lookup_core(tmp_path_factory):
    """``(core, model, tokenizer)``: a random tiny model with the lookup task's tokenizer
    (whose added tokens make decode then encode not a bijection), its end-of-sequence logit
    raised by :data:`EOS_BIAS`, on an ``hf`` engine core (``submit``)."""
    from transformers import AutoModelForCausalLM

    from rlwire.trainer.agent.lookup import build_lookup_tokenizer
    from rlwire.trainer.models.tiny import build_tiny_model
    from rlwire.trainer.rollout.hf_batch import HFBatch
    from rlwire.trainer.rollout.requests import EngineCore

    tokenizer = build_lookup_tokenizer()
    path = build_tiny_model(tmp_path_factory.mktemp("lookup-core") / "tiny", tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = tokenizer.eos_token_id

    def favour_eos(_module, _inputs, logits):
        logits[..., eos] += EOS_BIAS
        return logits

    model.get_output_embeddings().register_forward_hook(favour_eos)
    core = EngineCore(HFBatch(model, eos_id=eos, pad_id=tokenizer.pad_token_id), max_num_seqs=8)
    yield core, model, tokenizer
    core.close()


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group in the test's process (an actor engine built here),
    met through a file (no port to bind and hand over)."""
    import torch.distributed as dist

    store = f"file://{tmp_path / 'rank-store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
