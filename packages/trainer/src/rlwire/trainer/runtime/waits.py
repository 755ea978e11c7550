"""Bounded waits on the job's Ray workers: every call waited for with a deadline, a worker's
death turned into one line naming it (:class:`Watch`; a rollout worker's is a
:class:`RolloutLost`, which the job may heal: :mod:`.healing`), and the workers' own close
before they are killed (:func:`close_workers`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import RunError
from ..rollout import EngineLost
from .cluster import Handle

__all__ = ["CLOSE_TIMEOUT", "RolloutLost", "Watch", "cause", "close_workers", "first_line"]


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def cause(err: BaseException) -> BaseException:
    """A Ray task's own error (``RayTaskError.cause``), else ``err`` itself."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


# Fetching a result ray.wait reported ready only moves it to this process: seconds at most.
_READY_GET_S = 60.0


# How long a failure waits for the other calls to show a worker's death behind it.
_PEER_DEATH_S = 2.0

_INTACT = "the last checkpoint in the run directory is intact (resume with the same command)"


class RolloutLost(RunError):
    """A rollout worker's process died: the line that stops the run, unless the job
    replaces the worker (:mod:`rlwire.trainer.runtime.healing`); ``index``: the worker."""

    def __init__(
        self, message: str, index: int, actor: str = "", *, engine_lost: bool = False
    ) -> None:
        super().__init__(message)
        self.index = index
        self.actor = actor
        """The dead worker's Ray actor id (hex): a replacement of the same index has another."""
        self.engine_lost = engine_lost
        """The worker lives but its engine is gone (:class:`~rlwire.trainer.rollout.
        EngineLost`: its server stopped answering)."""


class Watch:
    """Waits on Ray futures (bounded unless ``timeout`` is None) that fail at once when one
    of them fails or a rollout worker's loop ends; ``names``: Ray actor id (hex) -> the
    worker's name in messages (``actor rank 1``); ``rollouts``: Ray actor id (hex) -> the
    index of a rollout worker, whose death is a :class:`RolloutLost`."""

    def __init__(
        self,
        loops: list,
        names: dict[str, str] | None = None,
        rollouts: dict[str, int] | None = None,
    ) -> None:
        self.loops = loops
        self.names = names or {}
        self.rollouts = rollouts or {}
        self.heal: Callable[[RolloutLost], Any] | None = None
        """Fully async: given the death of a rollout worker whose loop is watched, start
        its replacement and return the replacement's loop (or raise the death)."""

    def get(self, refs, *, timeout: float | None, what: str):
        import ray

        single = not isinstance(refs, list)
        pending = [refs] if single else list(refs)
        values = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise RunError(f"{what}: no answer within {timeout:g} s")
            ready, _ = ray.wait(pending + self.loops, num_returns=1, timeout=left)
            for ref in ready:
                if ref in self.loops:
                    self.failed(ref)  # raises, or a replacement's loop takes its place
                    continue
                pending.remove(ref)
                try:  # the first failure stops the wait (its peers would only time out)
                    values[ref] = ray.get(ref, timeout=_READY_GET_S)
                except Exception as err:
                    reason = cause(err)
                    dead = self._dead(reason) or self._peer_died(pending)
                    if dead is not None:  # a worker process died (or lost its engine)
                        said, actor = dead
                        line = f"{what}: {said}; {_INTACT}"
                        if actor in self.rollouts:
                            lost = isinstance(reason, EngineLost)
                            index = self.rollouts[actor]
                            raise RolloutLost(line, index, actor, engine_lost=lost) from None
                        raise RunError(line) from None
                    raise RunError(
                        f"{what}: {type(reason).__name__}: {first_line(reason)}"
                    ) from None
        return values[refs] if single else [values[r] for r in refs]

    def ends(self, refs: list, *, timeout: float, what: str) -> list[str]:
        """Wait (``timeout`` s in all) for calls whose ends are all that is left of the
        run's work, such as the rollout loops once the last step is trained: a worker that
        died by then costs a line (returned, for the caller to log), not the run; any other
        failure, or no end in time, still raises."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        if len(ready) < len(refs):
            raise RunError(f"{what}: no answer within {timeout:g} s")
        lines = []
        for ref in refs:
            try:
                ray.get(ref, timeout=_READY_GET_S)  # ready: only fetched
            except Exception as err:
                reason = cause(err)
                dead = self._dead(reason)
                if dead is None:
                    raise RunError(
                        f"{what}: {type(reason).__name__}: {first_line(reason)}"
                    ) from None
                lines.append(f"{what}: {dead[0]}, after the run's last step: nothing was lost")
        return lines

    def _dead(self, reason: BaseException) -> tuple[str, str] | None:
        """The line naming the worker that ``reason`` says died (``actor rank 1 died
        (ActorDiedError: ...)``), or the rollout worker whose engine it says is lost (its
        server stopped answering: healed as a death), and its Ray actor id; None if it
        names none."""
        if isinstance(reason, EngineLost):
            actors = [a for a, i in self.rollouts.items() if i == reason.index]
            if not actors:
                return None
            actor = actors[-1]  # the worker's latest actor: a replacement comes after
            return f"{self.names[actor]} lost its engine ({first_line(reason)})", actor
        actor = getattr(reason, "actor_id", None) or ""
        who = self.names.get(actor)
        if who is None:
            return None
        return f"{who} died ({type(reason).__name__}: {first_line(reason)})", actor

    def _peer_died(self, pending: list) -> tuple[str, str] | None:
        """A peer's death behind another worker's error (a collective's peer that went away:
        the survivor's connection error may arrive first): the still pending calls that
        fail within :data:`_PEER_DEATH_S` as a worker's death, the first named."""
        import ray

        if not pending:
            return None
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_PEER_DEATH_S)
        for ref in ready:
            try:
                ray.get(ref, timeout=_READY_GET_S)
            except Exception as err:
                dead = self._dead(cause(err))
                if dead is not None:
                    return dead
        return None

    def failed(self, ref) -> None:
        import ray

        worker = self.loops.index(ref)
        try:
            ray.get(ref, timeout=_READY_GET_S)  # ready: ray.wait returned it
        except Exception as err:  # the worker's own error, or Ray's ActorDiedError
            reason = cause(err)  # the worker's exception, not Ray's wrapper of it
            line = (
                f"rollout worker {worker} stopped: {type(reason).__name__}: "
                f"{first_line(reason)}; {_INTACT}"
            )
            dead = self._dead(reason)
            if dead is not None and dead[1] in self.rollouts and self.heal is not None:
                lost = isinstance(reason, EngineLost)
                self.loops[worker] = self.heal(RolloutLost(line, worker, dead[1], engine_lost=lost))
                return
            raise RunError(line) from None
        raise RunError(f"rollout worker {worker} left its loop before the run ended")


CLOSE_TIMEOUT = 30.0
"""Seconds :func:`close_workers` waits, for all the workers together, for their own
``close`` (a rollout engine's threads, files and server processes: what no finalizer removes
once ``ray.kill`` ends the process) before it kills them anyway. A worker stuck in a call (a
decoding step, a collective whose peer died) holds the job's end this long at most; a dead
one not at all."""


def close_workers(
    workers: list[Handle], closes: list[tuple[str, Any]], *, timeout: float = CLOSE_TIMEOUT
) -> list[str]:
    """Wait up to ``timeout`` seconds in all for ``closes`` (``(name, ref)``: the workers'
    own ``close`` calls, made already), then end every process of ``workers`` with
    ``ray.kill``, whether its close ended or not. The lines naming each close that failed or
    did not end in time (the caller logs them)."""
    import ray

    refs = [ref for _, ref in closes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    problems = []
    for name, ref in closes:
        if ref not in ready:
            problems.append(f"{name}: its close did not end within {timeout:g} s; killed")
            continue
        try:
            ray.get(ref, timeout=_READY_GET_S)  # ready: only fetched
        except Exception as err:  # its own error, or Ray's: it had died
            reason = cause(err)
            problems.append(f"{name}: close failed: {type(reason).__name__}: {first_line(reason)}")
    for worker in workers:
        ray.kill(worker, no_restart=True)
    return problems
