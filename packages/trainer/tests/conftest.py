"""One Ray cluster for the trainer's tests that run jobs (starting one costs 10 to 16 s here).

The cluster lives in a process of its own, not in pytest's: a job joining it runs its driver
in pytest's process (``trainer_cli.train_cli``, or the driver's ``run()``), which connects
and disconnects at the end, as any user's driver does. Each job kills its own workers when
it ends, so jobs do not see each other.

Markers: every test that runs a Ray job (it takes the ``ray_cluster`` fixture, or says
``@pytest.mark.job``) is marked ``job``; ``floor`` marks the few jobs, one per strategy and
mode, that run by default (``uv run pytest``, and CI's floor leg on Python 3.12 and torch
2.11) besides every test that is not a job. The other jobs run with
``-m "job and not floor"`` (``.ci/run`` step 1b): each costs its workers' imports (about
5 s of CPU a process here), and all of them together took about 5 minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


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
        address = _first_line(head, START_TIMEOUT)
        yield address
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)


def _first_line(process: subprocess.Popen, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError(f"the shared Ray cluster did not start within {timeout:g} s")
    line = process.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"the shared Ray cluster failed to start (exit {process.poll()})")
    return line


# The FSDP2 run that the other strategies are compared with (FSDP1 here, Megatron in
# test_trainer_megatron.py): run once per session. Two rollout engines, one per rank: the
# hybrid engine (each rank's own process), which test_trainer_strategies.py compares with
# rollout workers of their own.
FSDP2_REFERENCE = (
    "actor.world_size=2",
    "rollout.num_workers=2",
    "actor.optim.grad_clip=0.5",
    "ckpt_engine.digest=true",
    "trainer.save_every=1",
)


@pytest.fixture(scope="session")
def fsdp2_reference_run(ray_cluster, tmp_path_factory) -> Path:
    """The run directory of 3 steps of FSDP2 on 2 gloo ranks with :data:`FSDP2_REFERENCE`
    (a checkpoint after every step; rollout engines in the ranks' processes)."""
    from trainer_cli import train_cli

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
