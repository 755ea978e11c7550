"""Fully async: a rollout worker receives the next weights beside the ones it generates
with, and writes them in between two decoding steps. Mixed into
:class:`~rlwire.trainer.runtime.rollout_worker.RolloutWorker`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from ..config.root import TrainerConfig
from ..rollout import RolloutEngine, StagingRolloutEngine
from ..rollout.digest import digest_of_parts
from .background import idle_budget, wait_moving

__all__ = ["WeightStage"]


class WeightStage:
    """The staging half of a rollout worker (``RolloutWorker`` sets ``config``, ``index``,
    ``engine`` and ``version``, and loads the engine :meth:`_loaded` returns)."""

    config: TrainerConfig
    index: int
    engine: Any
    version: int

    if TYPE_CHECKING:  # RolloutWorker's, declared for the type checker only

        def _loaded(self) -> RolloutEngine: ...

    def __init__(self) -> None:
        self._slot = threading.Condition()  # the staged update, from stage_weights to run
        self._staged: tuple[int, Callable[[], int]] | BaseException | None = None

    def stage_weights(self, version: int) -> bool:
        """Fully async, on the ``receive`` concurrency group while :meth:`run` generates:
        receive update ``version`` beside the weights in use; :meth:`run` writes it in
        between two decoding steps. An engine that cannot stage (a third party's without
        :class:`~rlwire.trainer.rollout.StagingRolloutEngine`) receives when it is written
        in instead, as the sender's peer then. Returns whether it staged the update."""
        backend = self._loaded()
        if not backend.stages_updates:
            return False
        with self._slot:
            if self._staged is not None:
                raise RuntimeError(
                    f"rollout worker {self.index}: version {version} arrived before the "
                    "previous update was written in"
                )
        try:
            commit = asyncio.run(cast(StagingRolloutEngine, backend).stage(self.engine))
            staged: tuple[int, Callable[[], int]] | BaseException = (version, commit)
        except BaseException as err:  # handed to run(), which stops with it
            staged = err
        with self._slot:
            self._staged = staged
            self._slot.notify_all()
        if isinstance(staged, BaseException):
            raise staged
        return True

    def _drop_staged(self) -> None:
        """Forget an update received and not written in (or its error): its group was left
        (:meth:`RolloutWorker.engine_init` joins a re-formed one, which sends afresh); the
        engine keeps the weights it holds."""
        with self._slot:
            self._staged = None

    def _take_staged(self, version: int, timeout: float) -> dict[str, Any]:
        """Write in the update :meth:`stage_weights` receives, waiting for it while it
        moves: ``timeout`` (``ckpt_engine.timeout``) bounds each wait of the transfer, not
        the whole (a large model's takes longer), so this fails only after
        :func:`~.background.idle_budget` seconds without progress (the receiver handle's
        ``progressed_at``: each item received; a handle without it: that long in all).
        Its version, digest and ``commit_s``: the seconds generation stopped for the
        commit (the weights written in between two decoding steps)."""
        from rlwire.ckpt_engine import CheckpointEngineError

        idle = idle_budget(timeout)
        with self._slot:

            def received(seconds: float) -> bool:
                return self._slot.wait_for(lambda: self._staged is not None, seconds)

            def progress() -> float | None:  # the receiver's handle (a re-formed group's)
                return getattr(self.engine, "progressed_at", None)

            while True:
                if not wait_moving(received, progress, idle):
                    raise TimeoutError(
                        f"rollout worker {self.index}: weights {version}: the receive made no "
                        f"progress for {idle:g} s after reaching a boundary (ckpt_engine."
                        f"timeout={timeout:g} s per wait, twice, and 30 s)"
                    )
                staged, self._staged = self._staged, None
                # A transfer that failed (aborted for a member's death, or its peer gone)
                # is sent again to a re-formed group (engine_init, then stage_weights):
                # wait for it with the weights in use; a failure the driver does not heal
                # stops the run there (the driver sees this receive's error too).
                if not isinstance(staged, CheckpointEngineError):
                    break
        assert staged is not None  # what wait_for waited for
        if isinstance(staged, BaseException):
            raise staged
        expected, commit = staged
        paused: list[float] = []

        def timed() -> int:  # in the core's thread: generation stops for this only
            began = time.perf_counter()
            try:
                return commit()
            finally:
                paused.append(time.perf_counter() - began)

        self.version = self._loaded().between_steps(timed)
        if self.version != expected:
            raise RuntimeError(
                f"rollout worker {self.index}: received version {self.version}, expected {expected}"
            )
        return {**self._held(), "commit_s": sum(paused)}

    def _held(self) -> dict[str, Any]:
        """What a pull reports of the weights held now: the version and, with
        ``ckpt_engine.digest`` (a checking run), their digest and ``source_pids``: the
        processes whose ``shm`` segments this worker maps, read from the kernel
        (:func:`rlwire.ckpt_engine.mapped_segment_owners`; None off ``shm`` or ``/proc``),
        so that a run can show which actor rank each engine received from."""
        if not self.config.ckpt_engine.digest:
            return {"version": self.version, "worker": self.index, "digest": None}
        from rlwire.ckpt_engine import mapped_segment_owners

        owners = mapped_segment_owners() if self.config.ckpt_engine.backend == "shm" else None
        engine = self._loaded()
        parts = engine.digest_parts()  # one pass: the digest is theirs, hashed
        return {
            "version": self.version,
            "worker": self.index,
            "digest": engine.digest() if parts is None else digest_of_parts(parts),
            "digest_parts": parts,
            "source_pids": None if owners is None else sorted(owners),
        }
