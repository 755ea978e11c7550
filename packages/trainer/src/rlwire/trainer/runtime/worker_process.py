"""What every worker process shares: its device, its address, its torch threads, its seeds,
and where Ray placed it."""

from __future__ import annotations

import os
import random

import torch

from ..config.root import TrainerConfig
from ..models.modeling import preload_hf

__all__ = [
    "WorkerProcess",
    "device",
    "free_port",
    "host",
    "is_loopback",
    "seed_everything",
    "set_threads",
]


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host() -> str:
    """The address other workers reach this one at: loopback on a one-node cluster, the
    node's IP when there are several."""
    import ray

    if sum(1 for node in ray.nodes() if node.get("Alive")) <= 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP or ``localhost``) is this machine's loopback."""
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def free_port(address: str) -> int:
    """A TCP port at ``address`` that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def set_threads(config: TrainerConfig, model: torch.nn.Module) -> None:
    """torch threads for this process by ``ray.worker_threads`` (automatic: by the model's
    size and the cores of this node)."""
    parameters = sum(p.numel() for p in model.parameters())
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores = len(usable) if usable else os.cpu_count() or 1
    torch.set_num_threads(config.worker_threads(parameters, cores))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _exit_on_sigterm() -> None:
    """SIGTERM ends this worker process at once (exit status 143), as SIGKILL would: the
    job then sees its death (a rollout worker is replaced). Ray's own handler waits for
    the task in progress to end, and a worker with concurrency groups runs its tasks off
    the main thread: fully async's loop never ends by itself, so a SIGTERMed rollout worker
    neither served nor died (the fault campaign's hang). Set from the actor's main thread
    (its ``__init__``); outside a Ray actor (a test or a tool building the class itself)
    nothing is set."""
    import signal
    import sys
    import threading

    ray = sys.modules.get("ray")  # an actor's process has imported it (the device check has not)
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))


class WorkerProcess:
    """What every worker does as its process starts, and what the driver asks of any
    worker about where it runs."""

    def __init__(self, config: TrainerConfig) -> None:
        _exit_on_sigterm()
        # one thread until the model is loaded (automatic threads are set by its size)
        torch.set_num_threads(config.ray.worker_threads or 1)
        preload_hf()  # while the driver prepares: the model is loaded later
        self.config = config
        self.device = device()

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()

    def node(self) -> tuple[str, int]:
        """The Ray node this worker runs on (its id), and its pid there."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()
