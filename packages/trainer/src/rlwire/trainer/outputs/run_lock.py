"""One live run per run directory: an exclusive ``flock`` on ``<run_dir>/.lock``, held for the
run's whole life and released by the kernel when its process ends however it ends (a kill
included), so that a stale lock never outlives a run. A second run on the same directory
would interleave checkpoints, metrics and exports with the first's."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from ..errors import RunError

__all__ = ["RunLock"]


class RunLock:
    """The lock of ``run_dir``, taken at once or refused (:class:`RunError` naming the
    holder's process id); :meth:`release` when the run ends."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"
        self._file: IO[str] | None = open(self.path, "a+")  # noqa: SIM115  # held open
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            self._file = None
            raise RunError(
                f"trainer.output_dir: {run_dir} is in use by a live run (process {holder}); "
                "wait for it to end, or choose another trainer.output_dir"
            ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
