"""One member of a checkpoint-engine group, run as its own process by the tests and the bench.

Usage: python ckpt_engine_worker.py BACKEND SCENARIO RANK WORLD_SIZE RENDEZVOUS_DIR OUT

Rank 0 sends, writing its prepare() metadata to RENDEZVOUS_DIR/meta.json for
the receivers. Scenarios:
  roundtrip  three updates (versions 1, 2, 3); receivers take update 2 with copy=False
  shared     roundtrip, with the sender's tensors moved into shared memory once
             (shm only) and updated in place between versions
  kill       the last receiver dies (os._exit) in the middle of update 1
  abort      kill, and the sender, seeing that receiver's process gone, aborts the update
             (engine.abort from a thread of its own, as a caller that watches its
             members does)
  corrupt    checksum=True; receiver 1 flips one byte of the first bucket it gets
  delta      delta="on", five versions with sparse changes (make_delta_state); receivers
             hold their weights and pass base_version, applying what arrives
  delta-zstd delta with compress="zstd"
  delta-missed
             delta, but receiver 2 drops update 3 (as a failed apply would): update 4
             must come dense to everyone, update 5 as a delta again
  delta-corrupt
             delta with checksum=True; receiver 1 flips one byte of the first delta bucket
The CUDA backends (nccl, cuda_ipc) send from the GPU with checksum=True. BACKEND
broadcast-cpu is the nccl/hccl engine class run on the CPU over gloo.
OUT receives a torch.save'd report.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import torch

from rlwire.ckpt_engine import CheckpointEngineError, Delta, registry

BUCKET = 64 << 10
TIMEOUT = 15.0
# The failure scenarios wait out the engine's timeout on purpose: a shorter one keeps
# them quick (the members start together, forked from one server, so forming the group
# takes far less).
FAILURE_TIMEOUT = 3.0


def make_state(version: int, small_tensors: int = 2_000) -> list[tuple[str, torch.Tensor]]:
    """Every awkward case at once, with ``small_tensors`` one-element tensors (many entries
    per bucket: 2,000 fill about an eighth of one; the Python work per tensor in three
    processes is most of a roundtrip test's time, 10,000 took 9-11 s against 1-4 s);
    values depend on ``version``."""
    g = torch.Generator().manual_seed(version)
    state = [
        ("fp32", torch.randn(1000, generator=g)),
        ("bf16_odd", torch.randn(333, generator=g).to(torch.bfloat16)),  # 666 bytes, then...
        ("fp32_after_odd", torch.randn(7, generator=g)),
        ("fp16", torch.randn(17, 3, generator=g).to(torch.float16)),
        ("int64", torch.randint(-(2**62), 2**62, (129,), generator=g)),
        ("bool", torch.rand(77, generator=g) > 0.5),
        ("empty", torch.empty(0, 5)),
        ("scalar", torch.tensor(float(version) + 0.25)),
        ("non_contiguous", torch.randn(40, 30, generator=g).t()),
        ("bigger_than_bucket", torch.randn(3 * BUCKET // 4 + 11, generator=g)),  # 3 buckets
    ]
    small = torch.randint(0, 1000, (small_tensors,), generator=g, dtype=torch.int32)
    state += [(f"small.{i}", small[i : i + 1].clone()) for i in range(small_tensors)]
    return state


DELTA_VERSIONS = (1, 2, 3, 4, 5)


def make_delta_state(version: int) -> list[tuple[str, torch.Tensor]]:
    """``make_state(1)`` changed at a few random elements of every tensor per version, as an
    optimizer step changes bf16 weights: 1% of the elements (at least one), 20% for
    ``bf16_odd`` (which then travels as a bitmask), all of ``fp16`` (which then travels
    dense), none of ``fp32_after_odd`` (an empty delta). With 1,000 small tensors, not
    2,000: each small tensor is encoded on its own, and the roundtrip scenarios already
    pack 2,000 into buckets."""
    # Each version from the one before, with one generator running through them all; every
    # version is made once per process and kept (the checks ask for them again and again).
    held = max((v for v in _DELTA_STATES if v <= version), default=None)
    state, g = _DELTA_STATES[held] if held is not None else (None, None)
    if state is None:
        held = 1
        state, g = make_state(1, small_tensors=1_000), torch.Generator().manual_seed(1000)
        _DELTA_STATES[1] = ([(name, t.clone()) for name, t in state], _copied(g))
    state = [(name, t.clone()) for name, t in state]
    g = _copied(g)
    for v in range(held + 1, version + 1):
        for name, t in state:
            flat = t.view(-1) if t.is_contiguous() else t.t().view(-1)  # a view either way
            share = {"bf16_odd": 0.2, "fp16": 1.0, "fp32_after_odd": 0.0}.get(name, 0.01)
            k = max(1, int(flat.numel() * share)) if flat.numel() and share else 0
            where = torch.randperm(flat.numel(), generator=g)[:k]
            if t.dtype == torch.bool:
                flat[where] = ~flat[where]
            elif t.dtype.is_floating_point:
                flat[where] = flat[where] + torch.randn(k, generator=g).to(t.dtype) + v
            else:
                flat[where] = flat[where] + v
        _DELTA_STATES[v] = ([(name, t.clone()) for name, t in state], _copied(g))
    return state


_DELTA_STATES: dict[int, tuple[list[tuple[str, torch.Tensor]], torch.Generator]] = {}


def _copied(g: torch.Generator) -> torch.Generator:
    copy = torch.Generator()
    copy.set_state(g.get_state())
    return copy


def _wait_for(path: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}")
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def _engine(backend: str, scenario: str, rank: int, rendezvous: str):
    options = {
        "bucket_size": BUCKET,
        "timeout": FAILURE_TIMEOUT if scenario in ("kill", "corrupt", "delta-corrupt") else TIMEOUT,
        "is_master": rank == 0,
        # The CUDA backends always verify (the checksum reads device buffers there).
        "checksum": scenario in ("corrupt", "delta-corrupt") or backend in ("nccl", "cuda_ipc"),
    }
    if scenario.startswith("delta"):
        options["delta"] = "on"
    if scenario == "delta-zstd":
        options["compress"] = "zstd"
    if backend == "filesystem":
        options["root"] = os.path.join(rendezvous, "weights")
    if backend == "broadcast-cpu":  # the nccl/hccl engine's code, on the CPU over gloo
        from rlwire.ckpt_engine.backends._broadcast import BroadcastEngine

        return BroadcastEngine(device_type="cpu", collective_backend="gloo", **options)
    return registry.new(backend, **options)


def _corrupt_first_bucket(engine, delta: bool = False) -> None:
    if hasattr(engine, "_next"):
        original = engine._next
        done = []

        async def corrupted(seq):
            meta, buf = await original(seq)
            if not done and (meta.base is not None if delta else seq == 0):
                done.append(seq)
                # A private copy: with shm the slot is shared with the other receiver.
                buf = buf.clone()
                buf[meta.entries[0].offset] ^= 0xFF
            return meta, buf

        engine._next = corrupted
    else:  # filesystem: corrupt the first tensor read from disk
        import safetensors.torch as st

        original_load = st.load_file

        def load_file(path, *args, **kwargs):
            tensors = original_load(path, *args, **kwargs)
            first = next(iter(tensors.values()))
            first.view(-1).view(torch.uint8)[0] ^= 0xFF
            return tensors

        st.load_file = load_file


def _on_engine_device(engine, state: list[tuple[str, torch.Tensor]]) -> list:
    """``state`` where the engine's buckets live: the CUDA backends send from the GPU."""
    if getattr(engine, "device", None) is None:
        return state
    return [(name, t.to(engine.device)) for name, t in state]


async def delta_sender(engine, scenario: str, out: str) -> None:
    report: dict = {"stats": [], "error": None}
    try:
        for version in DELTA_VERSIONS:
            state = _on_engine_device(engine, make_delta_state(version))
            stats = await engine.send_weights(state, version=version)
            report["stats"].append(stats)
        report["mirror_bytes"] = engine.delta.nbytes
    except CheckpointEngineError as err:
        report["error"] = [type(err).__name__, str(err)]
    torch.save(report, out)


async def delta_receiver(engine, scenario: str, rank: int, out: str) -> None:
    """Hold weights across updates, applying deltas onto them as a rollout worker would."""
    report: dict = {"updates": [], "deltas": [], "error": None}
    if scenario == "delta-corrupt" and rank == 1:
        _corrupt_first_bucket(engine, delta=True)
    held: dict[str, torch.Tensor] = {}
    version = None
    try:
        for _ in DELTA_VERSIONS:
            new, deltas = dict(held), 0
            async for name, item in engine.receive_weights(copy=False, base_version=version):
                if isinstance(item, Delta):
                    new[name] = item.apply_(held[name].clone())
                    deltas += 1
                else:
                    new[name] = item.clone()
            if scenario == "delta-missed" and rank == 2 and engine.last_version == 3:
                continue  # dropped: this receiver still holds version 2
            held, version = new, engine.last_version
            report["updates"].append((version, [(n, t.cpu()) for n, t in held.items()]))
            report["deltas"].append(deltas)
    except CheckpointEngineError as err:
        report["error"] = [type(err).__name__, str(err)]
    torch.save(report, out)


def _abort_when_gone(engine, pid_file: str) -> None:
    """The ``abort`` scenario's watcher: once the dying receiver's process is gone, abort
    the update, naming it."""
    from rlwire.ckpt_engine import process_running

    pid = int(_wait_for(pid_file, 60))
    while process_running(pid):
        time.sleep(0.01)
    engine.abort(f"receiver process {pid} died")


async def sender(engine, scenario: str, out: str, rendezvous: str = "") -> None:
    report: dict = {"stats": [], "error": None}
    start = time.monotonic()
    if scenario == "abort":
        pid_file = os.path.join(rendezvous, "dying.pid")
        threading.Thread(target=_abort_when_gone, args=(engine, pid_file), daemon=True).start()
    shared = None
    if scenario == "shared":
        shared = make_state(1)
        report["shared_bytes"] = engine.share_weights(shared)
        report["token"] = engine._token
    try:
        for version in (1, 2, 3) if scenario in ("roundtrip", "shared") else (1,):
            state = _on_engine_device(engine, make_state(version))
            if shared is not None:  # the trainer updates its (shared) weights in place
                for (_, mine), (_, new) in zip(shared, state, strict=True):
                    mine.copy_(new)
                state = shared
            stats = await engine.send_weights(state, version=version)
            report["stats"].append([stats.bytes, stats.tensors, stats.buckets])
        # A lower version than the last one sent is refused.
        try:
            await engine.send_weights([], version=0)
        except CheckpointEngineError as err:
            report["lower_version_error"] = str(err)
    except CheckpointEngineError as err:
        report["error"] = [type(err).__name__, str(err)]
    report["seconds"] = time.monotonic() - start
    torch.save(report, out)
    if scenario == "abort":  # the master's store serves the abort until the survivor read it
        survivor = os.path.join(rendezvous, "rank1.pt")
        deadline = time.monotonic() + 60
        while not os.path.exists(survivor) and time.monotonic() < deadline:
            time.sleep(0.02)


async def receiver(engine, scenario: str, rank: int, world_size: int, out: str) -> None:
    report: dict = {"updates": [], "error": None}
    if scenario == "corrupt" and rank == 1:
        _corrupt_first_bucket(engine)
    try:
        for update in range(3 if scenario in ("roundtrip", "shared") else 1):
            copy = update != 1
            got = []
            async for name, tensor in engine.receive_weights(copy=copy):
                if scenario in ("kill", "abort") and rank == world_size - 1 and len(got) == 1000:
                    os._exit(3)
                # A zero-copy view is only valid until the next item: copy it now.
                got.append((name, tensor.cpu() if copy else tensor.clone().cpu()))
            report["updates"].append((engine.last_version, got))
    except CheckpointEngineError as err:
        report["error"] = [type(err).__name__, str(err)]
    torch.save(report, out)


def _all_started(rendezvous: str, rank: int, world_size: int, timeout: float = 120) -> None:
    """Wait until every member has imported torch: on a loaded machine the imports take
    seconds and finish seconds apart, which the engine's timeout should not have to cover."""
    open(os.path.join(rendezvous, f"started-{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(
        os.path.exists(os.path.join(rendezvous, f"started-{r}")) for r in range(world_size)
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every member started within {timeout:g} s")
        time.sleep(0.02)


def main(
    backend: str, scenario: str, rank: int, world_size: int, rendezvous: str, out: str
) -> None:
    if backend == "nccl":  # one GPU per member (NCCL refuses two ranks on one device)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    _all_started(rendezvous, rank, world_size)
    engine = _engine(backend, scenario, rank, rendezvous)
    meta = engine.prepare()
    meta_path = os.path.join(rendezvous, "meta.json")
    if rank == 0:
        with open(meta_path + ".tmp", "w") as f:
            json.dump(meta, f)
        os.replace(meta_path + ".tmp", meta_path)
    else:
        meta = _wait_for(meta_path, 60)
    engine.init_process_group(rank=rank, world_size=world_size, master_metadata=meta)
    if scenario.startswith("delta"):
        run = (
            delta_sender(engine, scenario, out)
            if rank == 0
            else delta_receiver(engine, scenario, rank, out)
        )
    elif rank == 0:
        run = sender(engine, scenario, out, rendezvous)
    else:
        if scenario == "abort" and rank == world_size - 1:  # for the sender's watcher
            with open(os.path.join(rendezvous, "dying.pid.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(
                os.path.join(rendezvous, "dying.pid.tmp"), os.path.join(rendezvous, "dying.pid")
            )
        run = receiver(engine, scenario, rank, world_size, out)
    asyncio.run(run)
    engine.finalize()
    # The report is on disk. Leave without finalizing the interpreter: a gloo worker
    # thread still dropping Python references (it needs the GIL) while the interpreter
    # finalizes is ended with pthread_exit, which aborts the process ("terminate called
    # without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def member(args: tuple, log: str) -> None:
    """:func:`main` in a process forked from the tests' fork server (torch and this module
    already imported there: a member starts in milliseconds, not seconds), its output
    going to ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    main(*args)


if __name__ == "__main__":
    b, s, r, w, d, o = sys.argv[1:7]
    main(b, s, int(r), int(w), d, o)
