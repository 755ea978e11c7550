"""Fully async, on a rollout worker: groups in flight as tasks of their own, handed to the
sample queue one by one as they complete, while the worker keeps asking the queue what next.

One loop (``asyncio``, in the Ray call :meth:`RolloutWorker.run`) with these moves:

- **ask** :meth:`SampleQueue.next_task` (``may_generate`` while the worker's samples in
  flight leave room for a chunk under ``rollout.max_num_seqs``; a short poll otherwise);
- **generate**: each group of the chunk becomes a task: its ``rollout.n`` samples (or
  conversations) are requests to the engine, and the group goes to the queue
  (:meth:`SampleQueue.put`) as soon as its last sample ends;
- **sync**: the update the worker received meanwhile (``stage_weights``) is written in
  between two decoding steps (:meth:`RolloutEngine.between_steps`): with
  ``async.partial_rollout`` at once, the requests in flight carrying on with the new
  weights (each token keeps its version); without, once the groups in flight completed
  (each sample then has one version);
- **validate**: the held-out prompts, as a task beside the groups;
- **stop**: the groups in flight are abandoned (their prompts are in the queue's checkpoint
  position, to generate again on resume).

A group task that fails stops the loop with its error at the next move.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from ..rollout import Rollout, completions_rollout
from ..rollout.requests import sample_requests

__all__ = ["ServeLoop", "ShareClock", "generate_requests", "stamp_seconds"]


class ShareClock:
    """Wall seconds shared among the tasks running: each interval's length is split evenly
    over the tasks in flight during it, so the shares of all tasks add up to the time any
    was running (:attr:`Rollout.generate_s` of groups generated together)."""

    def __init__(self) -> None:
        self.running: dict[int, float] = {}
        self.last = time.perf_counter()

    def _advance(self) -> None:
        now = time.perf_counter()
        if self.running:
            share = (now - self.last) / len(self.running)
            for key in self.running:
                self.running[key] += share
        self.last = now

    def start(self, key: int) -> None:
        self._advance()
        self.running[key] = 0.0

    def stop(self, key: int) -> float:
        self._advance()
        return self.running.pop(key)


class ServeLoop:
    """The fully-async loop of one rollout worker (see the module docstring).

    Args:
        worker: the :class:`~rlwire.trainer.runtime.rollout_worker.RolloutWorker`.
        queue: the sample queue's actor handle.
        timeout: seconds any call to the queue may take.
    """

    def __init__(self, worker, queue, timeout: float) -> None:
        self.worker, self.queue, self.timeout = worker, queue, timeout
        self.config = worker.config
        self.tasks: set[asyncio.Task] = set()
        self.samples = 0  # samples in flight
        self.chunks = 0
        self.clock = ShareClock()
        self._one_call = threading.Lock()  # a third party's engine: one generate at a time

    async def _ask(self, ref, what: str):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout)
        except TimeoutError:
            raise TimeoutError(
                f"rollout worker {self.worker.index}: the sample queue did not answer "
                f"{what} within {self.timeout:g} s"
            ) from None

    def _room(self, chunk: int) -> bool:
        """Whether a chunk of ``chunk`` groups more fits under ``rollout.max_num_seqs`` (one
        always may when nothing is in flight)."""
        wanted = chunk * self.config.rollout.n
        return self.samples == 0 or self.samples + wanted <= self.config.rollout.max_num_seqs

    def _raise_failed(self) -> None:
        for task in [t for t in self.tasks if t.done()]:
            self.tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def _spawn(self, coro) -> None:
        self.tasks.add(asyncio.ensure_future(coro))

    async def serve(self) -> dict[str, Any]:
        """Until the queue says ``stop``."""
        index = self.worker.index
        chunk = 1  # the groups of a generation task (the queue's size: the last one seen)
        try:
            while True:
                self._raise_failed()
                room = self._room(chunk)
                task = await self._ask(
                    self.queue.next_task.remote(
                        index, may_generate=room, poll=None if room else 0.05
                    ),
                    "what next",
                )
                if task["kind"] == "stop":
                    return {"worker": index, "chunks": self.chunks, "version": self.worker.version}
                if task["kind"] == "wait":
                    continue
                if task["kind"] == "sync":
                    info = await self._sync(task["version"])
                    await self._ask(self.queue.worker_synced.remote(index, info), "the sync")
                    if "then" not in task:
                        continue
                    task = task["then"]
                if task["kind"] == "validate":
                    self._spawn(self._validate(task))
                    continue
                self.chunks += 1
                chunk = len(task["indices"])
                for position, (example, group) in enumerate(
                    zip(task["examples"], task["indices"], strict=True)
                ):
                    seed = task["seed"] * 131 + position
                    self._spawn(self._group(example, group, seed))
        finally:
            for task in self.tasks:
                task.cancel()

    async def _sync(self, version: int) -> dict[str, Any]:
        start = time.perf_counter()
        if not self.config.partial_rollouts() and self.tasks:
            await asyncio.wait(self.tasks)  # each sample of one version: the groups end first
            self._raise_failed()
        info = await asyncio.to_thread(self.worker.sync, version)
        return {**info, "wait_s": time.perf_counter() - start}

    async def _group(self, example, index: int, seed: int) -> None:
        n = self.config.rollout.n
        key = id(asyncio.current_task())
        started = self.worker.version
        self.samples += n
        self.clock.start(key)
        try:
            group = await self._generate([example], seed)
        finally:
            self.samples -= n
            seconds = self.clock.stop(key)
        stamp_seconds(group, seconds)
        group.examples = [example] * n
        # a group of failed agent sessions only holds no token, so no version of its own:
        # it is queued under the weights it started with (its lag is never counted)
        version = group.version
        if version is None:
            version = started
        await self._ask(
            self.queue.put.remote(self.worker.index, [version], [group], [index]),
            "a finished group",
        )

    async def _generate(self, examples: list, seed: int) -> Rollout:
        worker, backend = self.worker, self.worker._loaded()
        takes_requests = backend.serves_requests or backend.can_continue
        if worker.agent is None and not takes_requests:

            def one_at_a_time() -> Rollout:  # a third party's engine: one call at a time
                with self._one_call:
                    return worker.generate(examples, seed)

            return await asyncio.to_thread(one_at_a_time)
        return await generate_requests(worker, examples, seed)

    async def _validate(self, task: dict[str, Any]) -> None:
        """The held-out prompts beside the groups in flight: as requests where the engine
        batches them continuously, else (its own batched ``generate``: ``vllm``) between two
        calls of its lock-step core, never beside one."""
        worker, backend = self.worker, self.worker._loaded()

        def generate() -> Rollout:
            return worker.generate(task["examples"], task["seed"], task["sampling"])

        run = generate if backend.serves_requests else lambda: backend.between_steps(generate)
        out = await asyncio.to_thread(run)
        await self._ask(self.queue.put_validation.remote(self.worker.index, out), "validation")


def stamp_seconds(out: Rollout, seconds: float) -> None:
    """``seconds`` over the samples of ``out``, evenly (:attr:`Rollout.generate_s`)."""
    out.generate_s = torch.full((len(out),), seconds / max(1, len(out)), dtype=torch.float64)


async def generate_requests(worker, examples: list, seed: int) -> Rollout:
    """``examples``' training samples as requests to ``worker``'s engine, all in flight at
    once (conversations with ``agent.enable``), each token stamped with the version that
    sampled it: a fully-async group."""
    if worker.agent is not None:
        return await worker.conversations(examples, seed, None)
    backend = worker._loaded()
    cfg = worker.config.rollout
    tokenizer = backend.tokenizer
    encoded = tokenizer([e.prompt for e in examples], add_special_tokens=False)["input_ids"]
    rows = [list(ids) for ids in encoded for _ in range(cfg.n)]
    requests = sample_requests(
        rows,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        seed=seed,
        greedy=False,
        **cfg.truncation(),
    )
    futures = [asyncio.wrap_future(f) for f in backend.submit_all(requests)]
    try:
        done = await asyncio.wait_for(asyncio.gather(*futures), cfg.request_timeout)
    except TimeoutError:
        raise TimeoutError(
            f"rollout worker {worker.index}: a group was not generated within "
            f"{cfg.request_timeout:g} s (rollout.request_timeout)"
        ) from None
    return completions_rollout(tokenizer, rows, done)
