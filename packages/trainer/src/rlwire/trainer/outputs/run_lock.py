"""One live run per run directory: an exclusive ``flock`` on ``<run_dir>/.lock``, held for the
run's whole life and released by the kernel when its process ends however it ends (a kill
included), so that a stale lock never outlives a run. A second run on the same directory
would interleave checkpoints, metrics and exports with the first's."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import IO

from ..errors import RunError

__all__ = ["RunLock"]


class RunLock:
    """The lock of ``run_dir``, taken at once or refused (:class:`RunError` naming the
    holder's process id); :meth:`release` when the run ends."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"
        try:  # never through a link: a planted .lock -> elsewhere is not followed, nor cut
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise RunError(
                f"trainer.output_dir: cannot take {self.path} ({err.strerror}); a link there "
                "is refused: remove it"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunError(f"trainer.output_dir: {self.path} is not a regular file; remove it")
        self._file: IO[str] | None = os.fdopen(fd, "r+")
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
