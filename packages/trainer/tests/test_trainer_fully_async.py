"""Fully-async mode: the sample queue's staleness control (simulated workers), then real runs
with Ray: 2 rollout workers continuing responses across syncs (partial rollouts), weights
verified by digest after every sync, and a killed worker."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading

import pytest
from trainer_cli import train_cli

from rlwire.trainer.config.root import AsyncConfig, load_config
from rlwire.trainer.modes.sample_queue import SampleQueue, max_stale_groups


def _batches(step: int) -> list[tuple[str, str]]:
    return [(f"p{step}-{i}", f"a{step}-{i}") for i in range(4)]


def _queue(start_version: int = 0, **settings) -> SampleQueue:
    """A queue over the test batches, polling every 50 ms."""
    return SampleQueue(batches=_batches, start_version=start_version, seed=0, poll=0.05, **settings)


async def _simulate(
    *,
    staleness: float,
    trigger: int,
    workers: int,
    steps: int,
    max_lag: int,
    seed: int,
    start: int = 0,
    resume: dict | None = None,
    stop_after: int | None = None,
) -> dict:
    """Workers of random speed against a trainer; returns what the trainer consumed.

    ``stop_after``: the trainer checkpoints after that many updates (the queue's
    ``position``), having taken the next update's groups already as the real loop does,
    and the run ends there (those groups are lost with it); ``start`` and ``resume``: a run
    resumed from such a checkpoint."""
    rng = random.Random(seed)
    required = 4
    queue = _queue(
        start_version=start,
        resume=resume,
        groups_per_step=required,
        trigger_sync=trigger,
        staleness_threshold=staleness,
        max_version_lag=max_lag,
        num_workers=workers,
    )
    seen_stale: list[int] = []
    pushed: dict[int, asyncio.Event] = {}

    async def worker(w: int) -> None:
        version = -1
        while True:
            task = await queue.next_task(w)
            seen_stale.append(queue.stale)
            if task["kind"] == "stop":
                return
            if task["kind"] == "wait":
                continue
            if task["kind"] == "sync":  # blocks until the trainer sends, like the engine
                version = task["version"]
                await asyncio.wait_for(pushed.setdefault(version, asyncio.Event()).wait(), 5)
                await queue.worker_synced(w, {"version": version, "digest": None})
                if "then" not in task:
                    continue
                task = task["then"]  # the chunk after the sync, handed out with it
            await asyncio.sleep(rng.uniform(0.0005, 0.006))
            groups = [{"prompt": p} for p, _ in task["examples"]]
            await queue.put(w, [version] * len(groups), groups, task["indices"])

    tasks = [asyncio.create_task(worker(w)) for w in range(workers)]
    pushed.setdefault(start, asyncio.Event()).set()
    assert await queue.wait_synced(start, 5) is not None
    in_flight = None  # like the trainer: a push does not wait for the workers' boundaries
    consumed: list[tuple[int, int, str]] = []  # (trainer version, group version, prompt)
    position = None
    for step in range(start, steps):
        got = await queue.get(required, step, timeout=5)
        assert "groups" in got, got
        consumed += [
            (step, version, g["prompt"])
            for version, g in zip(got["versions"], got["groups"], strict=True)
        ]
        await asyncio.sleep(rng.uniform(0.001, 0.01))  # the update
        if step + 1 == stop_after:
            assert "groups" in await queue.get(required, step + 1, timeout=5)  # taken ahead
            position = await queue.position(step + 1)
            break
        if in_flight is not None:  # completed after the next update, before another starts
            assert await queue.wait_synced(in_flight, 5) is not None
            in_flight = None
        if (step + 1) % trigger == 0:
            await queue.request_sync(step + 1)
            pushed.setdefault(step + 1, asyncio.Event()).set()
            in_flight = step + 1
    if in_flight is not None:
        assert await queue.wait_synced(in_flight, 5) is not None
    if position is None:  # where a checkpoint at the end would leave the stream
        position = await queue.position(steps)
    await queue.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return {"consumed": consumed, "stale": seen_stale, "queue": queue, "position": position}


@pytest.mark.parametrize(
    ("staleness", "trigger", "workers"),
    [(0.0, 1, 2), (0.5, 1, 2), (1.0, 1, 3), (0.0, 2, 2), (1.5, 2, 1), (1.0, 3, 2)],
)
def test_queue_respects_the_staleness_bound_and_loses_nothing(staleness, trigger, workers):
    bound_lag = AsyncConfig(
        staleness_threshold=staleness, trigger_parameter_sync_step=trigger
    ).version_lag_bound()
    assert bound_lag == trigger * (1 + math.ceil(staleness)) - 1
    out = asyncio.run(
        _simulate(
            staleness=staleness,
            trigger=trigger,
            workers=workers,
            steps=4 * trigger,
            max_lag=bound_lag,
            seed=int(staleness * 10) + trigger,
        )
    )
    queue = out["queue"]
    assert (
        queue.bound == max_stale_groups(4, trigger, staleness) == int(4 * trigger * (1 + staleness))
    )
    assert max(out["stale"]) <= queue.bound  # workers never started more than the bound
    lags = [t - v for t, v, _ in out["consumed"]]
    assert min(lags) >= 0 and max(lags) <= bound_lag
    assert queue.dropped == 0  # the derived lag bound drops nothing
    if staleness == 0 and trigger == 1:
        assert max(lags) == 0  # on-policy
    if staleness == 0:  # workers outpace the trainer: held back by the bound, and it shows
        assert sum(queue.paused_s) > 0
    # every group is consumed once, in data order (the data position follows the step)
    prompts = [p for _, _, p in out["consumed"]]
    expected = [p for s in range(len(prompts) // 4) for p, _ in _batches(s)]
    assert sorted(prompts) == sorted(expected) and len(set(prompts)) == len(prompts)


@pytest.mark.parametrize(("staleness", "trigger", "workers"), [(1.0, 1, 2), (0.5, 2, 3)])
def test_a_resumed_queue_trains_every_group_once(staleness, trigger, workers):
    """Interrupted after 3 updates and resumed from the checkpoint's position, against a run
    that never stopped: the same groups are trained, none twice, none lost (those queued,
    being generated or taken ahead at the checkpoint are generated again)."""
    settings = {"staleness": staleness, "trigger": trigger, "workers": workers, "seed": 5}
    lag = AsyncConfig(
        staleness_threshold=staleness, trigger_parameter_sync_step=trigger
    ).version_lag_bound()
    whole = asyncio.run(_simulate(**settings, steps=8, max_lag=lag))
    first = asyncio.run(_simulate(**settings, steps=8, max_lag=lag, stop_after=3))
    position = first["position"]
    assert position["pending"] and position["next_group"] > 3 * 4  # generated ahead
    second = asyncio.run(_simulate(**settings, steps=8, max_lag=lag, start=3, resume=position))
    trained = [p for _, _, p in first["consumed"]] + [p for _, _, p in second["consumed"]]
    assert len(trained) == len(set(trained)) == len(whole["consumed"]) == 8 * 4
    assert min(v for _, v, _ in second["consumed"]) >= 3  # the version went on from 3
    # Nothing lost: every group before the stream's end was trained or is still pending,
    # in the resumed run as in the whole one (which groups finish first is the workers').
    for run, names in ((second, trained), (whole, [p for _, _, p in whole["consumed"]])):
        end = run["position"]
        left = {_batches(i // 4)[i % 4][0] for i in end["pending"]}
        every = {_batches(i // 4)[i % 4][0] for i in range(end["next_group"])}
        assert set(names) | left == every and not set(names) & left


def test_queue_drops_groups_older_than_max_version_lag():
    out = asyncio.run(_simulate(staleness=1.0, trigger=1, workers=2, steps=6, max_lag=0, seed=3))
    lags = [t - v for t, v, _ in out["consumed"]]
    assert lags and max(lags) == 0  # nothing stale reached the trainer
    assert out["queue"].dropped > 0  # with S=1 the workers ran ahead; those groups were dropped


def test_released_groups_stay_released_across_a_sync():
    """Dynamic sampling drops groups the trainer took for an update that has not run yet:
    they free their places under the bound, and the recount at the next sync must not
    count them again (it did: the workers then paused below verl's bound until the sync
    after)."""

    async def run() -> dict:
        queue = _queue(
            groups_per_step=4,
            trigger_sync=1,
            staleness_threshold=0.5,  # bound: 6 groups
            max_version_lag=1,
            num_workers=1,
        )
        await queue.worker_synced(0, {"version": 0, "digest": None})
        task = await queue.next_task(0)
        await queue.put(0, [0] * 4, [{}] * 4, task["indices"])
        assert len((await queue.get(4, 1, timeout=1))["groups"]) == 4  # taken for update 1
        await queue.release(2, 1)  # two of them had equal rewards
        await queue.request_sync(1)
        await queue.worker_synced(0, {"version": 1, "digest": None})
        return await queue.next_task(0)

    task = asyncio.run(run())
    assert task["kind"] == "generate"
    assert len(task["indices"]) == 4  # 6 minus the 2 taken groups still to be trained


def test_a_worker_holding_the_new_weights_generates_without_waiting_for_the_others():
    """Per-worker gating: once worker 0 took the requested version it generates again, while
    worker 1 is still in its chunk of the old weights; worker 1 is told to sync first."""

    async def run() -> tuple[dict, dict, dict]:
        queue = _queue(
            groups_per_step=4,
            trigger_sync=1,
            staleness_threshold=1.0,
            max_version_lag=1,
            num_workers=2,
        )
        for worker in (0, 1):
            await queue.worker_synced(worker, {"version": 0, "digest": None})
        first = [await queue.next_task(worker) for worker in (0, 1)]
        await queue.put(0, [0] * 2, [{}] * 2, first[0]["indices"])
        await queue.get(2, 0, timeout=1)
        await queue.request_sync(1)
        await queue.worker_synced(0, {"version": 1, "digest": None})
        ahead = await queue.next_task(0)  # worker 1 has not reached its boundary
        late = await queue.next_task(1)
        return ahead, late, {"sync_to": queue.sync_to, "versions": queue.worker_versions}

    ahead, late, state = asyncio.run(run())
    assert ahead["kind"] == "generate" and len(ahead["indices"]) == 2
    # worker 1 syncs first, and is handed the chunk after it with it (under the bound)
    assert late["kind"] == "sync" and late["version"] == 1
    assert late["then"]["kind"] == "generate" and len(late["then"]["indices"]) == 2
    assert state == {"sync_to": 1, "versions": [1, 0]}


def test_a_dead_workers_groups_go_back_first_and_a_sync_completes_without_it():
    """Worker 1 dies holding a chunk: its groups go back to be generated first (by worker
    0), their places under the bound are freed, a sync completes without it, and its
    replacement is handed nothing (``wait``) until it joined, then the sync, then groups."""

    async def run() -> dict:
        queue = _queue(
            groups_per_step=4,
            trigger_sync=1,
            staleness_threshold=0.0,
            max_version_lag=1,
            num_workers=2,
        )
        for worker in (0, 1):
            await queue.worker_synced(worker, {"version": 0, "digest": None})
        chunks = [await queue.next_task(worker) for worker in (0, 1)]
        await queue.put(0, [0] * 2, [{}] * 2, chunks[0]["indices"])
        full = await queue.next_task(0)  # the bound (4 groups) is full: worker 0 waits
        lost = await queue.worker_lost(1)
        counts = {"stale": queue.stale, "in_flight": queue.in_flight}
        again = await queue.next_task(0)  # the freed places: worker 1's groups first
        await queue.request_sync(1)
        await queue.worker_synced(0, {"version": 1, "digest": "d"})
        synced = await queue.wait_synced(1, 1)  # complete: worker 1 is absent
        absent = await queue.next_task(1)
        await queue.worker_joined(1)
        await queue.request_sync(2)
        joined = await queue.next_task(1)
        return {
            "chunks": chunks, "full": full, "lost": lost, "counts": counts, "again": again,
            "synced": synced, "absent": absent, "joined": joined,
            "position": await queue.position(0),
        }  # fmt: skip

    out = asyncio.run(run())
    assert out["chunks"][1]["indices"] == [2, 3] and out["full"]["kind"] == "wait"
    assert out["lost"] == [2, 3]
    assert out["counts"] == {"stale": 2, "in_flight": 0}  # only worker 0's 2 queued groups
    assert out["again"]["kind"] == "generate" and out["again"]["indices"] == [2, 3]
    assert out["synced"] == [{"version": 1, "digest": "d"}, {}]
    assert out["absent"]["kind"] == "wait"
    assert out["joined"]["kind"] == "sync" and out["joined"]["version"] == 2
    # none lost for a checkpoint: queued, regenerated, none twice
    assert out["position"]["pending"] == [0, 1, 2, 3]


def test_a_resent_version_is_taken_by_every_member_those_holding_it_too():
    """A member dies after the others wrote version 1 in (the sync completed without it):
    the push is sent again, whole, to the re-formed group (``resync``). The survivor, which
    holds 1, is told to take it again (it receives it again, and a received update must be
    written in before the next arrives: found by hand, a ``vllm_server`` replacement never
    told to take the re-send refused the next push), and so is the replacement; the sync
    completes once both did, and the next push asks each for its version once."""

    async def run() -> dict:
        queue = _queue(
            groups_per_step=4, trigger_sync=1, staleness_threshold=0.0, max_version_lag=1,
            num_workers=2,
        )  # fmt: skip
        for worker in (0, 1):
            await queue.worker_synced(worker, {"version": 0, "digest": None})
        await queue.request_sync(1)
        for worker in (0, 1):
            await queue.worker_synced(worker, {"version": 1, "digest": None})
        before = await queue.wait_synced(1, 0.05)  # complete: both hold 1
        await queue.worker_lost(1)
        await queue.worker_joined(1)  # the replacement, in the re-formed group
        await queue.resync(1)
        told = [await queue.next_task(w, may_generate=False) for w in (0, 1)]
        pending = await queue.wait_synced(1, 0.05)  # neither took it yet
        await queue.worker_synced(0, {"version": 1, "digest": None})
        half = await queue.wait_synced(1, 0.05)
        await queue.worker_synced(1, {"version": 1, "digest": None})
        done = await queue.wait_synced(1, 0.05)
        await queue.request_sync(2)
        await queue.worker_synced(0, {"version": 2, "digest": None})
        after = await queue.next_task(0, may_generate=False, poll=0.01)
        return {"before": before, "told": told, "pending": pending, "half": half,
                "done": done, "after": after}  # fmt: skip

    out = asyncio.run(run())
    assert out["before"] is not None
    assert [t["kind"] for t in out["told"]] == ["sync", "sync"]
    assert [t["version"] for t in out["told"]] == [1, 1]
    assert out["pending"] is None and out["half"] is None and out["done"] is not None
    assert out["after"]["kind"] == "wait"  # worker 0 holds 2: nothing to take again


def _lagging_queue(strategy: str) -> SampleQueue:
    return _queue(
        groups_per_step=2,
        trigger_sync=1,
        staleness_threshold=1.0,
        max_version_lag=0,
        num_workers=1,
        strategy=strategy,
    )


def test_groups_dropped_at_a_sync_request_are_counted_and_generated_again():
    """Two groups of version 0 wait in the queue when the sync to version 1 is requested:
    with ``drop`` they are dropped there, the next ``get`` reports them (it reported only
    its own drops, so these were never counted), and their prompts come first in the next
    task, generated with version 1."""

    async def run() -> tuple[dict, dict]:
        queue = _lagging_queue("drop")
        await queue.worker_synced(0, {"version": 0, "digest": None})
        task = await queue.next_task(0)
        await queue.put(0, [0, 0], [{}, {}], task["indices"][:2])
        await queue.request_sync(1)
        await queue.worker_synced(0, {"version": 1, "digest": None})
        again = await queue.next_task(0)
        await queue.put(
            0, [1] * len(again["indices"]), [{}] * len(again["indices"]), again["indices"]
        )
        return task, again, await queue.get(2, 1, timeout=1)

    task, again, got = asyncio.run(run())
    assert got["dropped"] == 2 and got["versions"] == [1, 1]
    assert again["indices"][:2] == task["indices"][:2]  # the dropped prompts, first


def test_keep_trains_groups_past_the_lag_bound():
    async def run() -> dict:
        queue = _lagging_queue("keep")
        await queue.worker_synced(0, {"version": 0, "digest": None})
        task = await queue.next_task(0)
        await queue.put(0, [0, 0], [{}, {}], task["indices"][:2])
        await queue.request_sync(1)
        return await queue.get(2, 1, timeout=1)

    got = asyncio.run(run())
    assert got["dropped"] == 0 and got["versions"] == [0, 0]


def test_a_worker_whose_weights_lag_too_far_is_handed_no_group():
    """With ``drop`` and ``max_version_lag=0``, once the trainer asked for update 1's groups a
    worker still on version 0 gets none to generate (they could only be dropped) until it
    syncs; with ``keep`` it does."""

    async def run(strategy: str) -> dict:
        queue = _lagging_queue(strategy)
        await queue.worker_synced(0, {"version": 0, "digest": None})
        await queue.get(2, 1, timeout=0.05)  # the trainer is at update 1 (nothing queued)
        return await queue.next_task(0)

    assert asyncio.run(run("drop"))["kind"] == "wait"
    assert asyncio.run(run("keep"))["kind"] == "generate"


def test_queue_get_times_out_instead_of_hanging():
    queue = _queue(
        groups_per_step=4,
        trigger_sync=1,
        staleness_threshold=0.0,
        max_version_lag=0,
        num_workers=1,
    )
    # nothing is ever queued: the get answers by its own timeout, or the test fails at 60 s
    got = asyncio.run(asyncio.wait_for(queue.get(4, 0, timeout=0.3), 60))
    assert got == {"timeout": True, "queued": 0, "dropped": 0}


def test_async_section_keys_and_verl_alias():
    config = load_config(
        overrides=[
            "trainer.mode=fully_async",
            "async.staleness_threshold=1",
            "async_training.trigger_parameter_sync_step=2",
        ]
    )
    assert config.async_.staleness_threshold == 1.0
    assert config.async_.trigger_parameter_sync_step == 2
    assert config.async_.version_lag_bound() == 3


@pytest.mark.parametrize(
    ("world", "workers", "gpus", "mode", "actors", "rollouts", "backend"),
    [
        (1, 1, 0, "colocated", None, None, "shm"),  # CPUs, one host
        (1, 1, 1, "colocated", [0], [0], "cuda_ipc"),  # one GPU shared
        (2, 1, 2, "colocated", [0, 1], [0], "cuda_ipc"),  # the worker beside rank 0
        (2, 2, 2, "colocated", [0, 1], [0, 1], "gloo"),  # one worker shares rank 0's GPU
        (1, 3, 4, "fully_async", [0], [1, 2, 3], "nccl"),  # a GPU for every member
        (1, 4, 2, "fully_async", [0], [1, 1, 1, 1], "gloo"),  # the rollout GPU is shared
        (2, 1, 2, "fully_async", [0, 1], [0], "cuda_ipc"),  # no GPU left: shared again
    ],
)
def test_gpu_layout_and_the_auto_checkpoint_engine(
    world, workers, gpus, mode, actors, rollouts, backend
):
    from rlwire.trainer.runtime.cluster import engine_backend, gpu_layout

    layout = gpu_layout(world, workers, gpus, mode)
    if actors is None:
        assert layout is None
    else:
        assert (layout.actors, layout.rollouts) == (actors, rollouts)
    assert engine_backend("auto", layout, one_host=True) == backend
    assert engine_backend("gloo", layout, one_host=True) == "gloo"  # an explicit choice stands
    if layout is None:  # CPUs on several hosts: no shared memory between them
        assert engine_backend("auto", layout, one_host=False) == "gloo"
        # nor on one host where /dev/shm cannot hold the weights (a small container's)
        assert engine_backend("auto", layout, one_host=True, shm_bytes=1 << 60) == "gloo"
    if layout:  # processes on one GPU split it evenly; so do its vLLM engines their budget
        for gpu in range(layout.gpus):
            members = (layout.actors + layout.rollouts).count(gpu)
            assert layout.share(gpu) * members == pytest.approx(1.0)
        for worker, gpu in enumerate(layout.rollouts):
            assert layout.rollout_share(worker) == 1.0 / layout.rollouts.count(gpu)


def test_fewer_gpus_than_actor_ranks_is_refused():
    from rlwire.trainer.errors import RunError
    from rlwire.trainer.runtime.cluster import gpu_layout

    with pytest.raises(RunError, match=r"^actor.world_size: 4 actor ranks need 4 GPUs \(NCCL"):
        gpu_layout(4, 1, 2, "colocated")
    with pytest.raises(
        RunError, match=r"need 1 GPUs \(NCCL: one GPU per rank\); the cluster has 0.5$"
    ):
        gpu_layout(1, 1, 0.5, "colocated")  # a fraction of a GPU holds no actor rank


def test_sync_cadence_counts_from_the_global_step_across_a_resume():
    from rlwire.trainer.modes.fully_async import sync_due

    whole = [step for step in range(10) if sync_due(step, 3, 10)]
    assert whole == [2, 5, 8]  # after updates 3, 6 and 9 of 10
    # Resumed at step 4 (the checkpoint after 4 updates): the same syncs from there on.
    assert [step for step in range(4, 10) if sync_due(step, 3, 10)] == [5, 8]


# --- real runs --------------------------------------------------------------------------------
@pytest.mark.floor
def test_partial_rollouts_two_workers_weights_reach_every_worker(ray_cluster, tmp_path):
    """Two workers, weights pushed every 2nd update, responses continued across each sync.

    The workers are made slower than the trainer (the paced engine, 20 ms a decoding step;
    one micro-batch for the update): they never pause on the staleness bound, so every sync
    is written in between two decoding steps in the middle of their responses. (A worker's
    death in fully async: the next test. Here it would leave one worker for most of the run,
    whose responses continued across a sync are trained after the run's last step.)"""
    run = tmp_path / "run"
    records, _ = train_cli(
        run,
        "ckpt_engine.digest=true",
        "trainer.mode=fully_async",
        "rollout.num_workers=2",
        "trainer.steps=6",
        "async.staleness_threshold=1",
        "async.trigger_parameter_sync_step=2",
        "async.partial_rollout=true",
        "rollout.backend=paced",
        "rollout.paced_step_s=0.02",
        "rollout.max_new_tokens=24",
        "actor.micro_batch_size=64",
        cluster=ray_cluster,
    )
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    bound = 2 * (1 + 1) - 1  # T x (1 + ceil(S)) - 1
    versions = [r["weight_version"] for r in records]
    assert versions == [0, 2, 2, 4, 4, 4]  # synced after every 2nd update (not after the last)
    assert sum(r["rollout_commit_s"] for r in records) > 0  # each commit stopped generation
    digests = []
    for r in records:
        # a sample's lag is its oldest token's: every token is within the bound
        assert 0 <= r["version_lag_max"] <= bound and r["version_lag_mean"] <= r["version_lag_max"]
        assert r["dropped_samples"] == 0 and r["wait_for_samples_s"] >= 0
        assert r["rollout_paused_s"] >= 0 and 0.0 <= r["reward_mean"] <= 1.0
        # generation stopped only for the commits, part of the time a sync was waited for
        assert 0 <= r["rollout_commit_s"] <= r["rollout_sync_wait_s"]
        assert r["optimizer_steps"] == 1 and r["rollout_is_mean"] > 0
        assert r["version_span_max"] in (0, 2)  # a sync moves the weights 2 versions on
        if r["step"] in (2, 4):  # a sync step: the members hold exactly what the actor sent
            assert r["weight_sync_gbps"] > 0
            assert r["weight_digest_rollout"] == [r["weight_digest_actor"]] * 2
            digests.append(r["weight_digest_actor"])
        else:
            assert "weight_digest_actor" not in r
    assert len(set(digests)) == 2  # the weights changed between syncs
    continued = [r["continued_fraction"] for r in records if r["version_span_max"] == 2]
    assert continued and all(0 < c <= 1 for c in continued), records
    assert (run / "checkpoints" / "step_6" / "COMPLETE").exists()
    assert_every_group_once(run, records)
    # each worker's engine closed before the kill (on its own group, beside the ended loop)
    assert "closing the job" not in (run / "train.log").read_text()


def test_a_sync_waits_for_generation_longer_than_the_transfer_timeout(ray_cluster, tmp_path):
    """Each chunk of generation (paced: 0.2 s per decoding step, up to 16) outlasts the
    checkpoint engine's 1 s timeout. The workers receive every sync while they generate, so the
    transfer never waits for a boundary, and the wait for the boundary is bounded by
    ``async.sample_timeout`` (a sync used to time out here: the transfer started only at the
    worker's boundary, under the transfer's deadline). Worker 0 dies (SIGKILL,
    :mod:`dying_rollout`) as it receives that sync: the push is aborted on every member and
    sent again, whole, to worker 1 alone (the replacement joins no later sync: there is
    none); the run ends with exit 0."""
    run = tmp_path / "run"
    records, out = train_cli(
        run,
        "ckpt_engine.digest=true",
        "ckpt_engine.timeout=1",
        "trainer.mode=fully_async",
        "rollout.num_workers=2",
        "trainer.steps=2",
        "rollout.backend=dying_rollout:PacedDiesInSync",
        "rollout.paced_step_s=0.2",
        "rollout.max_new_tokens=16",
        cluster=ray_cluster,
    )
    assert (run / "rollout-died").exists()  # it did die, in the sync
    assert "rollout worker 0 died; starting its replacement (restart 1 of 3" in out
    assert [r["weight_version"] for r in records] == [1, 1]
    assert [r["rollout_restarts"] for r in records] == [1, 1]
    synced = records[0]  # the survivor holds exactly what the actor sent
    assert synced["weight_digest_rollout"] == [synced["weight_digest_actor"]]
    trained = [i for r in records for i in r["group_indices"]]  # its groups went back:
    assert len(trained) == len(set(trained))  # none trained twice
    # the trained samples' generation, past twice the transfer's 1 s timeout (a step's samples
    # carry only their share of a chunk's seconds: after the death the survivor's chunk of the
    # 12 groups sent back is split over two steps, so the sum is taken over the run)
    assert sum(r["time_generate_s"] for r in records) > 2 * 1.0


def assert_every_group_once(run, records: list[dict]) -> None:
    """Each prompt group trained at most once, 8 per step, and every group the stream
    started was trained or is still pending in the last checkpoint (to generate again on
    resume): none lost (a group dropped for its lag goes back to be generated again: it
    is trained later or pending, not lost)."""
    trained = [i for r in records for i in r["group_indices"]]
    assert len(trained) == len(set(trained)) == 8 * len(records)
    final = json.loads(
        (run / "checkpoints" / f"step_{len(records)}" / "trainer_state.json").read_text()
    )
    pending, started = set(final["queue"]["pending"]), final["queue"]["next_group"]
    assert not pending & set(trained)
    assert set(trained) | pending == set(range(started))


def test_background_runs_one_coroutine_at_a_time_and_hands_back_its_outcome():
    from rlwire.trainer.runtime.background import Background

    sending = Background("weight push")
    release = threading.Event()
    order: list[str] = []

    async def send(name: str) -> str:
        await asyncio.to_thread(release.wait, 5)
        order.append(name)
        return name

    assert sending.finish(timeout=1) is None  # nothing in flight
    assert sending.start(lambda: send("v1"), timeout=1) is None
    with pytest.raises(TimeoutError, match=r"^weight push: not finished within 0.05 s$"):
        sending.finish(timeout=0.05)  # still ours: a later finish waits again
    release.set()
    assert sending.start(lambda: send("v2"), timeout=5) == "v1"  # the previous one first
    assert sending.finish(timeout=5) == "v2" and order == ["v1", "v2"]

    async def fail() -> None:
        raise RuntimeError("receiver 2 died")

    sending.start(fail, timeout=1)
    with pytest.raises(RuntimeError, match="receiver 2 died"):
        sending.finish(timeout=5)
    assert sending.finish(timeout=1) is None


@pytest.mark.parametrize(("chunk_groups", "sizes"), [(None, [2, 2, 2, 2]), (4, [4, 4])])
def test_a_task_is_as_many_groups_as_async_chunk_groups_says_within_the_bound(chunk_groups, sizes):
    """Default: a step's groups over the workers; ``async.chunk_groups`` sets it (multi-turn
    rollouts amortise a tool's latency over larger tasks); the bound caps what is handed
    out either way."""

    async def run():
        queue = _queue(
            groups_per_step=4,
            trigger_sync=1,
            staleness_threshold=1.0,  # bound: 8 groups
            max_version_lag=1,
            num_workers=2,
            chunk_groups=chunk_groups,
        )
        await queue.worker_synced(0, {"version": 0, "digest": None})
        tasks = []
        for _ in range(len(sizes)):
            tasks.append(await queue.next_task(0))
        return tasks

    tasks = asyncio.run(run())
    assert [len(t["indices"]) for t in tasks] == sizes


def test_partial_rollouts_are_on_by_default_in_fully_async_mode_only():
    """verl's default, resolved after the overrides: a config whose mode is set by an
    override (its sections built before it) still gets them (it did not: the default was
    resolved against the default mode, colocated, and stored)."""
    assert load_config(overrides=["trainer.mode=fully_async"]).partial_rollouts()
    assert not load_config().partial_rollouts()
    off = ["trainer.mode=fully_async", "async_training.partial_rollout=false"]
    assert not load_config(overrides=off).partial_rollouts()


@pytest.mark.job
def test_each_actor_rank_diffs_its_own_shard_and_the_workers_hold_what_the_actor_sent(
    ray_cluster, tmp_path
):
    """``ckpt_engine.delta_sharded``: two FSDP2 ranks, bf16 at a small learning rate (few
    elements change), fully async (the snapshot and its background send). Each rank diffs
    its shard, rank 0 gathers the changes into its copy: after every sync the worker holds
    exactly what the actor holds (digests), and each sync after the first is a delta of
    far fewer bytes than the weights."""
    records, _ = train_cli(
        tmp_path / "run",
        "ckpt_engine.digest=true",
        "ckpt_engine.delta=on",
        "ckpt_engine.delta_sharded=true",
        "trainer.mode=fully_async",
        "actor.world_size=2",
        "model.dtype=bfloat16",
        "actor.optim.lr=3e-6",
        "trainer.steps=4",
        cluster=ray_cluster,
    )
    synced = [r for r in records if r.get("weight_digest_rollout")]
    assert len(synced) >= 3
    for r in synced:
        assert r["weight_digest_rollout"] == [r["weight_digest_actor"]]
    later = [r for r in records if r.get("weight_sync_wire_bytes")][1:]
    assert later and all(r["weight_sync_wire_bytes"] < r["weight_sync_bytes"] / 4 for r in later)
