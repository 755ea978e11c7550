"""The actor ranks' process group: its rendezvous store listens where the ranks reach it and
nowhere else (torch's own store server, behind ``MASTER_ADDR``/``MASTER_PORT``, listens on
every interface whatever address it is given)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from rlwire.ckpt_engine import bound_store
from rlwire.trainer.runtime.workers import join_group


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as ``/proc/net/tcp*`` writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                    found.append(address)
    return found


def test_on_one_node_the_actor_groups_store_listens_on_loopback_only():
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("reads the listening sockets from /proc/net/tcp (Linux)")
    store = bound_store("127.0.0.1", 30)  # what rank 0's address() makes on one node
    join_group("gloo", rank=0, world_size=1, master=("127.0.0.1", store.port), store=store)
    try:
        assert dist.get_world_size() == 1 and dist.get_rank() == 0
        assert _listening(store.port) == ["0100007F"]  # 127.0.0.1, and no wildcard
    finally:
        dist.destroy_process_group()
