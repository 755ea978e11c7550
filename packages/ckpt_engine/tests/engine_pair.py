"""A sender and one receiver of a backend joined in this process (their joins run in two
threads: each waits for the other), for tests that drive both from one event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from rlwire.ckpt_engine import CheckpointEngine, registry


def joined_pair(
    backend: str = "shm",
    *,
    bucket_size: int = 4096,
    timeout: float = 10,
    sender: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[CheckpointEngine, CheckpointEngine, dict[str, Any]]:
    """``(sender, receiver, the sender's metadata)``, joined; ``options`` go to both,
    ``sender`` to the sender only (``delta``, ``compress``)."""
    common = dict(bucket_size=bucket_size, timeout=timeout, **options)
    tx = registry.new(backend, is_master=True, **common, **(sender or {}))
    rx = registry.new(backend, **common)
    meta = tx.prepare()

    async def join() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            loop.run_in_executor(
                None, lambda: tx.init_process_group(rank=0, world_size=2, master_metadata=meta)
            ),
            loop.run_in_executor(
                None, lambda: rx.init_process_group(rank=1, world_size=2, master_metadata=meta)
            ),
        )

    asyncio.run(join())
    return tx, rx, meta
