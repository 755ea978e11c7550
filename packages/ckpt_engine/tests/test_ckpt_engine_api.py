"""Registry, sizes, wire format, lifetimes, the naive backend and apply_to_module (one process)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from rlwire.ckpt_engine import (
    DEFAULT_BUCKET_SIZE,
    CheckpointEngine,
    CheckpointEngineError,
    CheckpointEngineRegistry,
    CheckpointEngineTimeout,
    apply_to_module,
    backend_for_device,
    parse_bucket_size,
    registry,
    stage_update,
)
from rlwire.ckpt_engine._bucketed import BucketedEngine
from rlwire.ckpt_engine._wire import ALIGN, BucketMeta, as_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_pair import joined_pair  # noqa: E402

# --- registry -----------------------------------------------------------------------


def test_available_lists_every_backend_and_status_says_which_can_be_built():
    everything = ["cuda_ipc", "filesystem", "gloo", "hccl", "naive", "nccl", "shm"]
    assert registry.available() == everything
    status = registry.status()
    assert list(status) == everything
    assert status["hccl"].startswith("install torch_npu")  # not installed here
    cuda = torch.cuda.is_available()
    for name in ("nccl", "cuda_ipc"):
        assert status[name] == (None if cuda else "needs a CUDA device")
    assert {"gloo", "shm", "filesystem", "naive"} <= set(registry.usable())
    assert registry.usable() == [n for n in everything if status[n] is None]


def test_verl_style_class_level_calls_reach_the_default_registry():
    # verl's registry is class-level: code written for it calls the class.
    assert CheckpointEngineRegistry.available() == registry.available()
    assert CheckpointEngineRegistry.get("naive") is registry.get("naive")
    engine = CheckpointEngineRegistry.new("naive", is_master=True)
    assert isinstance(engine, CheckpointEngine) and engine.name == "naive"

    @CheckpointEngineRegistry.register("naive-for-class-test")
    class Registered(Loopback):
        """Registered through the class: visible through the instance."""

    try:
        assert registry.get("naive-for-class-test") is Registered
        with pytest.raises(ValueError, match="'naive-for-class-test' is already registered"):
            registry.register("naive-for-class-test")(Registered)
    finally:  # the default registry is the process's: leave it as the other tests expect
        del registry._classes["naive-for-class-test"]
    # An instance of its own stays separate.
    assert "naive-for-class-test" not in CheckpointEngineRegistry().available()


def test_device_mapping():
    assert [backend_for_device(d) for d in ("cuda", "npu", "cpu")] == ["nccl", "hccl", "gloo"]
    with pytest.raises(
        ValueError, match=r"^device_type: 'tpu' has no default backend; known: cpu, cuda, npu$"
    ):
        backend_for_device("tpu")


def test_unknown_name_lists_available_and_missing_extras():
    with pytest.raises(ValueError) as err:
        registry.new("carrier-pigeon")
    message = str(err.value)
    assert message.startswith(
        "unknown checkpoint engine 'carrier-pigeon'; available: filesystem, gloo, naive, shm"
    )
    assert "; unavailable here: " in message and "hccl (install torch_npu" in message
    if not torch.cuda.is_available():
        assert "cuda_ipc (needs a CUDA device)" in message
        assert "nccl (needs a CUDA device)" in message


def test_backend_with_missing_dependency_names_what_to_install():
    with pytest.raises(ImportError, match="'hccl' is unavailable here: install torch_npu"):
        registry.new("hccl")
    # The class itself (importable without torch_npu) says the same when built.
    from rlwire.ckpt_engine.backends._broadcast import HcclEngine

    with pytest.raises(ImportError, match=r"^the hccl checkpoint engine needs torch_npu"):
        HcclEngine(is_master=True)


def test_broadcast_engine_refuses_an_unknown_collective_backend():
    from rlwire.ckpt_engine.backends._broadcast import BroadcastEngine

    with pytest.raises(
        CheckpointEngineError,
        match=r"^collective_backend: 'mpi' is not supported; use 'nccl', 'hccl', 'gloo'$",
    ):
        BroadcastEngine(device_type="cpu", collective_backend="mpi", is_master=True)


def test_duplicate_registration_raises():
    reg = CheckpointEngineRegistry()

    @reg.register("mine")
    class Mine(Loopback):
        """A second registered name for the same transport."""

    assert reg.get("mine") is Mine
    with pytest.raises(ValueError, match="checkpoint engine 'mine' is already registered"):
        reg.register("mine")(Mine)
    with pytest.raises(ValueError, match="checkpoint engine 'gloo' is already registered"):
        reg.register("gloo")(Mine)


def test_importing_the_package_imports_no_optional_dependency():
    code = (
        "import sys, rlwire.ckpt_engine as c; c.registry.available(); "
        "print(sorted(m for m in ('safetensors', 'torch_npu', 'ray', 'vllm') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_entry_point_backend_is_discovered(tmp_path, monkeypatch):
    (tmp_path / "echo_backend.py").write_text(
        textwrap.dedent("""
        from rlwire.ckpt_engine.backends._naive import NaiveEngine

        class EchoEngine(NaiveEngine):
            name = "echo"
    """)
    )
    info = tmp_path / "echo_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[rlwire.ckpt_engine.backends]\necho = echo_backend:EchoEngine\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = CheckpointEngineRegistry()
    assert "echo" in reg.available()
    engine = reg.new("echo", is_master=True)
    assert type(engine).__name__ == "EchoEngine" and isinstance(engine, CheckpointEngine)


# --- sizes and options ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, DEFAULT_BUCKET_SIZE),
        (4096, 4096),
        ("512MiB", 512 << 20),
        ("2GB", 2 * 10**9),
        ("1.5 KiB", 1536),
        ("64kb", 64_000),
    ],
)
def test_bucket_sizes(value, expected):
    assert parse_bucket_size(value) == expected


def test_auto_bucket_size_is_bounded():
    assert 16 << 20 <= parse_bucket_size("auto") <= 1 << 30


@pytest.mark.parametrize(("backend", "theirs"), [("shm", "auto"), ("gloo", "2MiB")])
def test_receivers_take_the_masters_bucket_size(backend, theirs):
    import threading

    master = registry.new(backend, bucket_size="1MiB", is_master=True, timeout=30)
    meta = master.prepare()
    assert meta["bucket_size"] == 1 << 20
    receiver = registry.new(backend, bucket_size=theirs, timeout=30)
    joined = threading.Thread(
        target=master.init_process_group,
        kwargs={"rank": 0, "world_size": 2, "master_metadata": meta},
    )
    joined.start()
    receiver.init_process_group(rank=1, world_size=2, master_metadata=meta)
    joined.join(timeout=60)
    assert receiver.bucket_size == 1 << 20 and not joined.is_alive()
    weights = [("w", torch.arange(600_000, dtype=torch.float32))]  # 2.4 MB: three buckets
    sent = threading.Thread(
        target=lambda: asyncio.run(master.send_weights(weights, version=1)), daemon=True
    )
    sent.start()
    got = asyncio.run(_collect(receiver))
    sent.join(timeout=60)
    assert torch.equal(got[0][1], weights[0][1]) and receiver.last_version == 1
    receiver.finalize()
    master.finalize()


@pytest.mark.parametrize("bad", ["12 parsecs", "-5MB", 0, 255, True, 3.5, "auto-ish"])
def test_bad_bucket_size(bad):
    with pytest.raises(ValueError, match=r"^bucket_size: .* is not allowed; use bytes as an int"):
        parse_bucket_size(bad)


def test_bad_options_and_lifecycle_errors():
    with pytest.raises(ValueError, match=r"^timeout: 0 is not allowed"):
        registry.new("naive", timeout=0)
    engine = registry.new("naive", is_master=False)
    with pytest.raises(CheckpointEngineError, match="receive_weights before init_process_group"):
        engine.receive_weights()
    with pytest.raises(ValueError, match="the master is rank 0 and only rank 0 is the master"):
        engine.init_process_group(rank=0, world_size=2, master_metadata={})
    with pytest.raises(ValueError, match=r"^rank: 5 is not allowed; use -1 or 0..1"):
        engine.init_process_group(rank=5, world_size=2, master_metadata={})


# --- the shared bucket pipeline, through an in-memory transport ------------------------


class Loopback(BucketedEngine):
    """A real BucketedEngine whose transport is a list (one sender, one receiver, one object)."""

    name = "loopback"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.slots = [torch.zeros(self.bucket_size, dtype=torch.uint8) for _ in range(2)]
        self.sent: list[tuple[BucketMeta, torch.Tensor]] = []

    def prepare(self) -> dict:
        return {}

    def _join(self, rank, world_size, master_metadata) -> None:
        """Nothing to connect: sender and receiver share the list."""

    async def _acquire(self, slot, seq):
        """Slots are copied on emit, so one is always free."""

    async def _emit(self, slot, meta):
        self.sent.append((meta, self.slots[slot][: meta.nbytes].clone()))

    async def _drain(self, last_seq):
        """Everything emitted is already on the "wire"."""

    async def _next(self, seq):
        meta, data = self.sent[seq]
        return meta, data

    async def _release(self, meta):
        """The receiver holds copies; nothing to give back."""


def _loopback(bucket_size=1024, **kw) -> tuple[Loopback, Loopback]:
    tx = Loopback(bucket_size=bucket_size, is_master=True, **kw)
    rx = Loopback(bucket_size=bucket_size, **kw)
    rx.sent = tx.sent  # the "wire"
    tx.init_process_group(rank=0, world_size=2, master_metadata={})
    rx.init_process_group(rank=1, world_size=2, master_metadata={})
    return tx, rx


async def _collect(rx, copy=True):
    return [(n, t) async for n, t in rx.receive_weights(copy=copy)]


def test_wire_format_alignment_chunking_and_used_bytes():
    tx, rx = _loopback()
    weights = [
        ("odd_bf16", torch.arange(5, dtype=torch.bfloat16)),  # 10 bytes
        ("fp32", torch.arange(3, dtype=torch.float32)),
        ("big", torch.arange(700, dtype=torch.float32)),  # 2800 bytes > 1024
        ("scalar", torch.tensor(7, dtype=torch.int64)),
    ]
    stats = asyncio.run(tx.send_weights(weights, version=4))
    assert (stats.bytes, stats.tensors) == (10 + 12 + 2800 + 8, 4)
    metas = [m for m, _ in tx.sent]
    assert stats.buckets == len(metas) == 4
    for meta in metas:
        for e in meta.entries:
            assert e.offset % ALIGN == 0
        assert meta.nbytes <= 1024
    # fp32 after the 10-byte bf16 starts on the next 256-byte boundary.
    assert [(e.name, e.offset) for e in metas[0].entries][:2] == [("odd_bf16", 0), ("fp32", 256)]
    big = [e for m in metas for e in m.entries if e.name == "big"]
    assert [(e.chunk_offset, e.chunk_nbytes) for e in big] == [
        (0, 512),
        (512, 1024),
        (1536, 1024),
        (2560, 240),
    ]
    assert metas[-1].last and metas[-1].nbytes == 256 + 8  # only the used bytes
    got = asyncio.run(_collect(rx))
    assert rx.last_version == 4
    for (n, a), (m, b) in zip(got, weights, strict=True):
        assert n == m and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(as_bytes(a), as_bytes(b))


def test_zero_copy_views_are_emptied_when_the_consumer_moves_on():
    tx, rx = _loopback()
    asyncio.run(tx.send_weights([("a", torch.ones(4)), ("b", torch.full((4,), 2.0))], version=1))

    async def consume():
        kept = []
        async for _, t in rx.receive_weights(copy=False):
            assert t.numel() == 4  # valid now
            kept.append(t)
        return kept

    kept = asyncio.run(consume())
    assert [t.numel() for t in kept] == [0, 0]  # never silently stale


def test_owned_tensors_survive():
    tx, rx = _loopback()
    asyncio.run(tx.send_weights([("a", torch.ones(4))], version=1))
    ((name, t),) = asyncio.run(_collect(rx, copy=True))
    assert torch.equal(t, torch.ones(4))


def test_bad_items_and_versions():
    tx, _ = _loopback()
    with pytest.raises(CheckpointEngineError, match=r"weights must yield \(str, torch.Tensor\)"):
        asyncio.run(tx.send_weights([("a", [1, 2])], version=1))
    asyncio.run(tx.send_weights([], version=5))
    with pytest.raises(CheckpointEngineError, match="version 4 is lower than the last one sent"):
        asyncio.run(tx.send_weights([], version=4))


def test_inactive_trainer_rank_consumes_weights_and_sends_nothing():
    engine = Loopback(bucket_size=1024)
    engine.init_process_group(rank=-1, world_size=3, master_metadata={})
    seen = []

    def gen():
        for i in range(3):
            seen.append(i)
            yield f"w{i}", torch.zeros(2)

    stats = asyncio.run(engine.send_weights(gen(), version=1))
    assert seen == [0, 1, 2] and stats.bytes == 0 and engine.sent == []
    assert asyncio.run(_collect(engine)) == []


# --- naive backend and apply_to_module -------------------------------------------------


def _naive_group(receivers=2, **kw):
    tx = registry.new("naive", is_master=True, **kw)
    meta = tx.prepare()
    rxs = [registry.new("naive", **kw) for _ in range(receivers)]
    tx.init_process_group(rank=0, world_size=receivers + 1, master_metadata=meta)
    for r, rx in enumerate(rxs, 1):
        rx.prepare()
        rx.init_process_group(rank=r, world_size=receivers + 1, master_metadata=meta)
    return tx, rxs


def test_naive_three_updates_to_two_receivers():
    tx, rxs = _naive_group()

    async def run():
        results = []
        for version in (1, 2, 3):
            weights = [("w", torch.full((3,), float(version))), ("b", torch.tensor(version))]
            stats, *got = await asyncio.gather(
                tx.send_weights(weights, version=version), *[_collect(rx) for rx in rxs]
            )
            results.append((stats, got))
        return results

    for version, (stats, got) in zip((1, 2, 3), asyncio.run(run()), strict=True):
        assert stats.tensors == 2
        for per_receiver in got:
            assert torch.equal(per_receiver[0][1], torch.full((3,), float(version)))
    assert [rx.last_version for rx in rxs] == [3, 3]
    tx.finalize()


def test_naive_peers_awaited_in_one_event_loop_hand_over_without_a_thread():
    """Sender and receivers awaited together (one thread, as a hybrid engine does): every
    wait is met by the peers' turns, none is sent to a thread; the same with the receivers
    awaited first."""
    import concurrent.futures

    class NoThreads(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            raise AssertionError(f"a thread was asked to run {fn}")

    tx, rxs = _naive_group()

    async def run(version, receivers_first):
        asyncio.get_running_loop().set_default_executor(NoThreads())
        weights = [(f"w{i}", torch.full((4,), float(version + i))) for i in range(20)]
        receive = [_collect(rx) for rx in rxs]
        send = tx.send_weights(weights, version=version)
        if receivers_first:
            *got, _ = await asyncio.gather(*receive, send)
        else:
            _, *got = await asyncio.gather(send, *receive)
        return weights, got

    for version, receivers_first in ((1, False), (2, True)):
        weights, got = asyncio.run(run(version, receivers_first))
        for per_receiver in got:
            assert [n for n, _ in per_receiver] == [n for n, _ in weights]
            pairs = zip(per_receiver, weights, strict=True)
            assert all(torch.equal(a, b) for (_, a), (_, b) in pairs)
    assert [rx.last_version for rx in rxs] == [2, 2]
    tx.finalize()


def test_naive_stalled_receiver_times_the_sender_out():
    """A receiver that never consumes: once its queue holds ``max_pending`` items the sender
    waits for room at most ``timeout`` (1 s here, not the default) and fails naming it."""
    tx, (rx,) = _naive_group(receivers=1, timeout=1.0, max_pending=2)
    with pytest.raises(
        CheckpointEngineTimeout,
        match=r"^naive: receiver 1 is not consuming: no answer within 1 s or the peer failed "
        r"\(Full\)$",
    ):
        asyncio.run(tx.send_weights([(f"w{i}", torch.zeros(1)) for i in range(10)], version=1))
    assert rx._joined_channel.queues[1].qsize() == 2  # full: the third item found no room


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def _apply(module, weights, atomic, staging=None, swap=False):
    # a failed apply leaves the sender waiting for its acknowledgement until the timeout
    tx, (rx,) = _naive_group(receivers=1, timeout=1.0)

    async def run():
        return await asyncio.gather(
            tx.send_weights(weights, version=7),
            apply_to_module(module, rx, atomic=atomic, staging=staging, swap=swap),
            return_exceptions=True,
        )

    return asyncio.run(run())


def test_apply_to_module_reuses_a_kept_staging_copy_and_stays_atomic():
    module, staging = Tiny(), {}
    for seed in (1, 2):
        new = {
            "lin.weight": torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)),
            "lin.bias": torch.full((2,), float(seed)),
            "steps": torch.tensor(seed),
        }
        first = {k: v.data_ptr() for k, v in staging.items()}
        _, version = _apply(module, list(new.items()), True, staging)
        assert version == 7 and set(staging) == set(new)
        for name, value in module.state_dict().items():
            assert torch.equal(value, new[name])
        if first:  # the second update wrote into the same staging memory
            assert {k: v.data_ptr() for k, v in staging.items()} == first
    before = {k: v.clone() for k, v in module.state_dict().items()}
    bad = [("lin.weight", torch.randn(2, 3)), ("lin.bias", torch.randn(5))]
    _, err = _apply(module, bad, True, staging)
    assert isinstance(err, CheckpointEngineError)
    for name, value in module.state_dict().items():  # nothing applied
        assert torch.equal(value, before[name])


def test_stage_update_leaves_the_module_serving_until_commit():
    """A staged update is received whole while the module keeps its weights (a rollout
    engine generating meanwhile); commit writes it in at once, by storage with ``swap``;
    the handle commits once."""
    module, staging = Tiny(), {}
    before = {k: v.clone() for k, v in module.state_dict().items()}
    new = {
        "lin.weight": torch.ones(2, 3),
        "lin.bias": torch.full((2,), 2.0),
        "steps": torch.tensor(3),
    }
    tx, (rx,) = _naive_group(receivers=1, timeout=1.0)

    async def run():
        _, staged = await asyncio.gather(
            tx.send_weights(list(new.items()), version=4),
            stage_update(module, rx, staging=staging, swap=True),
        )
        return staged

    staged = asyncio.run(run())
    assert staged.version == 4
    for name, value in module.state_dict().items():  # received, not yet written
        assert torch.equal(value, before[name])
    weight = module.lin.weight
    assert staged.commit() == 4
    assert module.lin.weight is weight  # the parameter object stays, its storage changed
    for name, value in module.state_dict().items():
        assert torch.equal(value, new[name])
    with pytest.raises(CheckpointEngineError, match="StagedUpdate.commit: version 4 twice"):
        staged.commit()


def test_apply_to_module_takes_a_mapping_of_some_parameters_under_other_names():
    """A mapping receives into its tensors by its names (a LoRA adapter's wire names): the
    module's other weights stay as they were; a name it lacks, or one it holds but the
    update lacks, fails the whole update and changes nothing."""
    module = Tiny()
    bias = module.lin.bias.detach().clone()
    targets = {"adapter.weight": module.lin.weight}
    new = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
    _, version = _apply(targets, [("adapter.weight", new)], True, {}, swap=True)
    assert version == 7 and module.lin.weight is targets["adapter.weight"]
    assert torch.equal(module.lin.weight, new) and torch.equal(module.lin.bias, bias)
    _, err = _apply(targets, [("adapter.weight", new * 2), ("lin.bias", bias)], True)
    assert isinstance(err, CheckpointEngineError) and "unknown names: ['lin.bias']" in str(err)
    _, err = _apply({**targets, "b": module.lin.bias}, [("adapter.weight", new * 2)], True)
    assert isinstance(err, CheckpointEngineError) and "missing names: ['b']" in str(err)
    assert torch.equal(module.lin.weight, new)


def test_apply_to_module_swap_commits_by_storage_and_trades_it_with_staging():
    module, staging = Tiny(), {}
    module.tied = nn.Linear(3, 2)
    module.tied.weight = module.lin.weight  # one Parameter under two names
    param = module.lin.weight
    names = ["lin.weight", "lin.bias", "steps", "tied.weight", "tied.bias"]
    storages = [param.data_ptr()]
    for seed in (1, 2, 3):
        g = torch.Generator().manual_seed(seed)
        new = {name: torch.randn(2, 3, generator=g) for name in ("lin.weight", "tied.weight")}
        new["tied.weight"] = new["lin.weight"]
        new |= {"lin.bias": torch.randn(2, generator=g), "tied.bias": torch.randn(2, generator=g)}
        new["steps"] = torch.tensor(seed)
        _, version = _apply(module, [(n, new[n]) for n in names], True, staging, swap=True)
        assert version == 7 and module.lin.weight is param is module.tied.weight
        for name, value in module.state_dict().items():
            assert torch.equal(value, new[name]), name
        storages.append(param.data_ptr())
        # The module's storage and the kept staging never alias.
        assert param.data_ptr() not in {t.data_ptr() for t in staging.values()}
    # Swapped, not copied in: double-buffered between the module's first storage and the
    # staging allocated once.
    original, first, second, third = storages
    assert first != original and second == original and third == first
    before = {k: v.clone() for k, v in module.state_dict().items()}
    bad = [("lin.weight", torch.randn(2, 3)), ("lin.bias", torch.randn(5))]
    _, err = _apply(module, bad, True, staging, swap=True)
    assert isinstance(err, CheckpointEngineError)
    for name, value in module.state_dict().items():  # nothing applied
        assert torch.equal(value, before[name])


def test_apply_to_module_updates_by_name_and_returns_version():
    module = Tiny()
    new = {"lin.weight": torch.randn(2, 3), "lin.bias": torch.randn(2), "steps": torch.tensor(9)}
    for atomic in (True, False):
        _, version = _apply(module, list(new.items()), atomic)
        assert version == 7
        for name, value in module.state_dict().items():
            assert torch.equal(value, new[name])


def test_apply_to_module_atomic_failure_changes_nothing():
    module = Tiny()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    bad = [("lin.weight", torch.randn(2, 3)), ("lin.bias", torch.randn(5))]  # wrong shape
    _, err = _apply(module, bad, atomic=True)
    assert isinstance(err, CheckpointEngineError)
    assert "'lin.bias' is (5,) torch.float32 in the update but (2,) torch.float32" in str(err)
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name])


def test_apply_to_module_lists_unknown_and_missing_names():
    module = Tiny()
    _, err = _apply(
        module, [("lin.weight", torch.randn(2, 3)), ("head.w", torch.ones(1))], atomic=True
    )
    assert str(err) == (
        "apply_to_module: update does not match the module; unknown names: "
        "['head.w']; missing names: ['lin.bias', 'steps']"
    )


def test_capabilities_are_known_without_building_the_backend():
    from rlwire.ckpt_engine import BackendCapabilities

    cap = {name: registry.capabilities(name) for name in registry.available()}
    assert cap["shm"] == BackendCapabilities(
        device_type="cpu", uses_store=True, zero_copy=True, delta=True
    )
    assert cap["gloo"] == BackendCapabilities("cpu", uses_store=True, zero_copy=False, delta=True)
    assert (
        cap["naive"]
        == cap["filesystem"]
        == BackendCapabilities(device_type="cpu", uses_store=False, zero_copy=False, delta=False)
    )
    # Known here even where they cannot be built (no CUDA, no torch_npu on this machine).
    assert cap["nccl"] == cap["cuda_ipc"] == BackendCapabilities("cuda", True, False, True)
    assert cap["hccl"] == BackendCapabilities("npu", True, False, True)
    assert CheckpointEngineRegistry.capabilities("shm") == cap["shm"]  # verl-style, on the class
    with pytest.raises(ValueError, match="^unknown checkpoint engine 'pigeon'"):
        registry.capabilities("pigeon")


def test_shm_refuses_segments_its_file_system_cannot_hold(monkeypatch):
    """Writing past /dev/shm's free space would kill the process (SIGBUS): refused first."""
    import collections

    from rlwire.ckpt_engine.backends import _shm

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(_shm.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 3 << 20))
    engine = registry.new("shm", is_master=True, bucket_size="2MiB")
    with pytest.raises(CheckpointEngineError) as err:
        engine.prepare()
    assert str(err.value) == (
        f"shm: two bucket slots needs {4 << 20} bytes in /dev/shm but {3 << 20} are free; "
        "enlarge it (docker: --shm-size), choose a smaller bucket_size, or use the gloo backend"
    )
    engine.finalize()
    monkeypatch.setattr(_shm.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 5 << 20))
    engine = registry.new("shm", is_master=True, bucket_size="2MiB")
    engine.prepare()  # the slots fit; then only 1 MiB is left for a 2 MiB arena
    monkeypatch.setattr(_shm.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 1 << 20))
    with pytest.raises(CheckpointEngineError, match=r"^shm: share_weights needs 2097152 bytes"):
        engine.share_weights([("w", torch.zeros(1 << 19))])
    engine.finalize()


def test_shm_files_are_the_users_alone_and_never_someone_elses():
    """Slots and arenas are created 0600 (other local users cannot read the weights) with
    O_EXCL (a file planted under the name is refused, not written into)."""
    import stat

    from rlwire.ckpt_engine.backends import _shm

    old = os.umask(0)  # whatever the umask, never more than 0600
    try:
        engine = registry.new("shm", is_master=True, bucket_size="1MiB")
        metadata = engine.prepare()
        engine.share_weights([("w", torch.zeros(1024))])
        files = [*metadata["slots"], *(a[1] for a in engine._arenas)]
        assert len(files) == 3
        for path in files:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        engine.finalize()
    finally:
        os.umask(old)
    planted = os.path.join(_shm.SHM_DIR, f"rlwire-test-planted-{os.getpid()}")
    open(planted, "wb").close()  # an empty file someone else could have put there
    try:
        with pytest.raises(FileExistsError):
            _shm._create(planted, 4096)
        assert os.path.getsize(planted) == 0  # untouched
    finally:
        os.unlink(planted)


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                    found.append(address)
    return found


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_the_store_listens_on_the_hosts_address_only(backend):
    """torch's TCPStore listens on every interface whatever host it is given; the engine's
    listens on loopback when the host is (a stranger on the network cannot reach it)."""
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("reads the listening sockets from /proc/net/tcp (Linux)")
    engine = registry.new(backend, is_master=True, bucket_size="1MiB", host="127.0.0.1")
    metadata = engine.prepare()
    try:
        assert _listening_addresses(metadata["port"]) == ["0100007F"]  # 127.0.0.1 only
    finally:
        engine.finalize()
    with pytest.raises(CheckpointEngineError, match=r"^host '203.0.113.7': cannot listen there"):
        registry.new(backend, is_master=True, host="203.0.113.7").prepare()
    for wildcard in ("0.0.0.0", "::"):  # every interface: refused, never bound
        with pytest.raises(
            CheckpointEngineError, match=rf"^host '{wildcard}' would listen on every interface"
        ):
            registry.new(backend, is_master=True, host=wildcard).prepare()


def test_delta_mode_is_checked_and_offered_only_by_backends_that_can():
    with pytest.raises(
        ValueError, match=r"^delta: 'sometimes' is not allowed; use 'off', 'auto', 'on'$"
    ):
        registry.new("gloo", delta="sometimes")
    with pytest.raises(ValueError, match=r"^delta: 'on' is not offered by the naive backend"):
        registry.new("naive", delta="on")
    with pytest.raises(ValueError, match=r"^delta: 'auto' is not offered by the loopback backend"):
        Loopback(delta="auto")  # a bucketed engine without the version exchange
    with pytest.raises(TypeError, match="^Claims sets supports_delta but has no _exchange_held"):

        class Claims(Loopback):  # offering deltas needs the version exchange
            supports_delta = True

    assert registry.new("gloo", delta="auto", is_master=True).delta.mode == "auto"


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8]
)
@pytest.mark.parametrize(
    ("n", "share", "fmt"),
    [(333, 0.01, "gaps1"), (70_001, 0.004, "gaps2"), (4001, 0.2, "bits"), (64, 1.0, None)],
)
def test_delta_encoding_is_the_smallest_form_and_round_trips(dtype, n, share, fmt):
    from rlwire.ckpt_engine import _positions
    from rlwire.ckpt_engine._delta import _diff_cpu, _diff_torch, decode, encode

    g = torch.Generator().manual_seed(n)
    base = (torch.randn(n, generator=g) * 10).to(dtype)
    new = base.clone()
    where = torch.randperm(n, generator=g)[: max(1, int(n * share))]
    new[where] = ~new[where] if dtype == torch.bool else (new[where] + 3).to(dtype)
    k = int(
        (
            new.view(torch.uint8).view(-1, new.element_size())
            != base.view(torch.uint8).view(-1, new.element_size())
        )
        .any(1)
        .sum()
    )
    # The numpy path (CPU) and the torch path (accelerators) find the same changes.
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    for diff in (_diff_cpu, _diff_torch):
        prev = base.clone().view(words)
        found = diff(new.view(words), prev)
        assert torch.equal(prev, new.view(words))  # the mirror caught up either way
        if found is None:  # mostly changed: the CPU path copies instead of comparing
            assert diff is _diff_cpu and k > n // 2
            continue
        positions, values = found
        assert positions.numel() == values.numel() == k
    mirror = base.clone()
    got_fmt, changed, payload = encode(new, mirror)
    assert torch.equal(mirror.view(words), new.view(words))  # the mirror caught up
    assert changed == (n if k > n // 2 else k)  # mostly changed: counted whole
    if fmt is None:  # everything changed: dense is smaller, the tensor itself goes
        assert got_fmt is None and payload is new
        return
    size = new.element_size()
    changed_at = torch.ne(new.view(words), base.view(words)).nonzero().view(-1).tolist()
    gaps = [b - a - 1 for a, b in zip([-1, *changed_at], changed_at, strict=False)]

    def al(x: int) -> int:
        return -(-x // 8) * 8

    # a gap that does not fit its width (>= 255, >= 65535) follows in full as uint32
    e1, e2 = (sum(g >= limit for g in gaps) for limit in (255, 65535))
    sizes = {"gaps1": al(k) + al(4 * e1), "gaps2": al(2 * k) + al(4 * e2)}
    head = sizes.get(fmt, -(-n // 8))
    if fmt is not None and fmt != "bits":  # the smaller gap width is the one chosen
        assert sizes[fmt] == min(sizes.values())
    assert (got_fmt, payload.numel()) == (fmt, -(-head // 8) * 8 + k * size)
    target = base.clone()
    decode(got_fmt, changed, (n,), dtype, payload).apply_(target)
    assert torch.equal(target.view(words), new.view(words))
    if fmt == "bits":  # the bitmask, little-endian, as the accelerators' path writes it
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)
        bits = torch.zeros(-(-n // 8) * 8, dtype=torch.int64)
        bits[changed_at] = 1
        packed = (bits.view(-1, 8) * weights).sum(1).to(torch.uint8)[: -(-n // 8)]
        assert torch.equal(payload[: -(-n // 8)], packed)
        assert torch.equal(_positions.pack_bits(torch.tensor(changed_at), n), packed)
    # Compressed: zstd where it is smaller, the same delta after decoding.
    mirror = base.clone()
    zfmt, _, frame = encode(new, mirror, compress="zstd")
    if zfmt is not None and zfmt.endswith(".zst"):
        assert frame.numel() < payload.numel()
    target = base.clone()
    decode(zfmt, changed, (n,), dtype, frame).apply_(target)
    assert torch.equal(target.view(words), new.view(words))
    with pytest.raises(CheckpointEngineError, match=rf"^delta for \({n},\) "):
        decode(got_fmt, changed, (n,), dtype, payload).apply_(torch.empty(n + 1, dtype=dtype))


def test_delta_payload_that_does_not_fit_its_metadata_is_refused():
    """A payload whose positions or size disagree with its metadata is refused with one
    error naming the problem, before anything is applied."""
    from rlwire.ckpt_engine._delta import decode, encode

    base = torch.zeros(2000, dtype=torch.bfloat16)
    new = base.clone()
    new[[3, 130, 999, *range(1000, 1200, 10)]] = 1.0
    fmt, k, payload = encode(new, base.clone())
    assert (fmt, k) == ("gaps1", 23)
    assert payload[:5].tolist() == [3, 126, 255, 0, 9]  # 868 does not fit a byte: escaped
    assert payload[24:28].view(torch.int32).item() == 868  # after the 23 gaps, aligned
    cases = {
        "unknown delta format 'idx'": ("idx", 23, payload),
        "but 24 gaps of 1 bytes": ("gaps1", 24, payload),
        "outside a tensor of 1100 elements": ("gaps1", 23, payload, (1100,)),
        "not a zstd frame": ("gaps1.zst", 23, payload),
        "delta of 2001 changes in a tensor of 2000": ("gaps1", 2001, payload),
        "an escaped gap that fits its width": ("gaps1", 23, _with(payload, 25, 0)),
        "with 3 escaped take 40": ("gaps1", 23, _with(_with(payload, 4, 255), 5, 255)),
    }
    for message, (f, changed, data, *shape) in cases.items():
        with pytest.raises(CheckpointEngineError, match=message):
            decode(f, changed, shape[0] if shape else (2000,), torch.bfloat16, data)


def test_a_zstd_frame_over_the_tensors_size_is_refused_before_it_is_inflated():
    """python-zstandard ignores ``max_output_size`` when a frame records its size: a 275-byte
    frame of 8 MiB is refused by what it claims, as is one that records no size."""
    zstd = pytest.importorskip("zstandard")
    from rlwire.ckpt_engine._delta import decode

    def frame(data: bytes, **kwargs) -> torch.Tensor:
        raw = zstd.ZstdCompressor(**kwargs).compress(data)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    bomb = frame(b"\0" * (8 << 20))
    assert bomb.numel() < 300
    with pytest.raises(CheckpointEngineError) as err:
        decode("gaps1.zst", 23, (2000,), torch.bfloat16, bomb)
    assert "a zstd frame of 8388608 bytes, over the 4000 the tensor's layout allows" in str(err)
    sizeless = frame(b"\1" * 64, write_content_size=False)
    with pytest.raises(CheckpointEngineError, match="a zstd frame that does not record its size"):
        decode("gaps1.zst", 23, (2000,), torch.bfloat16, sizeless)
    # a frame of nothing (found by the fuzzer: a ValueError from torch.frombuffer escaped)
    with pytest.raises(CheckpointEngineError, match="payload of 0 bytes cannot hold 23 gaps1"):
        decode("gaps1.zst", 23, (2000,), torch.bfloat16, frame(b""))


def _with(payload: torch.Tensor, at: int, value: int) -> torch.Tensor:
    out = payload.clone()
    out[at] = value
    return out


def test_apply_to_module_takes_deltas_atomically_through_shm_in_one_process():
    """Sender and receiver in one event loop (shm's control runs in threads): every
    update after the first is a delta; a tensor that did not change travels as an empty one."""
    from rlwire.ckpt_engine import apply_to_module

    torch.manual_seed(0)
    sent = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7)).bfloat16()
    held = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7)).bfloat16()
    tx, rx, _ = joined_pair(timeout=20, sender={"delta": "on"})

    async def run() -> list:
        staging, version, stats = {}, None, []
        for v in range(1, 5):
            with torch.no_grad():
                for name, p in sent.named_parameters():
                    if name != "1.bias" or v == 2:  # 1.bias changes once only
                        p[torch.rand(p.shape) < 0.05] += 1
            s, version = await asyncio.gather(
                tx.send_weights(list(sent.state_dict().items()), version=v),
                apply_to_module(held, rx, staging=staging, version=version),
            )
            assert version == v
            for (name, a), b in zip(
                sent.state_dict().items(), held.state_dict().values(), strict=True
            ):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (v, name)
            stats.append(s)
        return stats

    try:
        stats = asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()
    nbytes = sum(p.numel() * 2 for p in sent.parameters())
    assert [s.base for s in stats] == [None, 1, 2, 3]
    assert stats[0].wire_bytes == nbytes and all(s.wire_bytes < nbytes // 4 for s in stats[1:])
    assert tx.delta.nbytes == nbytes


def test_changes_found_per_shard_are_sent_as_the_engine_would_and_keep_no_mirror():
    """Each of two "ranks" diffs its half of every tensor against its own copy (verl's
    delta_sharded); the halves' changes, moved to where they sit, go to ``send_weights(
    changes=)``: the receiver ends bit-identical after every update, each update sends the
    same bytes as the engine's own comparison, and the sender keeps no mirror."""
    from rlwire.ckpt_engine import Delta, apply_to_module, diff
    from rlwire.ckpt_engine._delta import encode

    torch.manual_seed(0)
    weights = {"a": torch.randn(64, 48).bfloat16(), "b": torch.randn(31, 7), "c": torch.zeros(5)}
    halves = {n: (0, len(t) // 2, len(t)) for n, t in weights.items()}
    shards = {n: [t[: halves[n][1]].clone(), t[halves[n][1] :].clone()] for n, t in weights.items()}
    whole = {n: t.clone() for n, t in weights.items()}  # what the engine's mirror would hold
    held = {n: torch.zeros_like(t) for n, t in weights.items()}
    tx, rx, _ = joined_pair(timeout=20, sender={"delta": "on"})

    def sharded_changes() -> dict[str, Delta | None]:
        changes: dict[str, Delta | None] = {}
        for name, t in weights.items():
            start, mid, end = halves[name]
            row = t[0].numel() if t.dim() > 1 else 1
            found = [
                diff(shards[name][0], t[start:mid].contiguous()),
                diff(shards[name][1], t[mid:end].contiguous()),
            ]
            if any(f is None for f in found):  # a half mostly changed: whole
                changes[name] = None
                continue
            positions = torch.cat([found[0].positions, found[1].positions + mid * row])
            values = torch.cat([f.values for f in found])
            changes[name] = Delta(tuple(t.shape), t.dtype, positions, values)
        return changes

    def engine_would_send() -> int:
        total = 0
        for name, t in weights.items():
            fmt, _, payload = encode(t, whole[name])
            total += payload.numel() if fmt else t.numel() * t.element_size()
        return total

    async def run() -> list:
        version, sent = None, []
        for v in range(1, 5):
            if v > 1:
                with torch.no_grad():
                    weights["a"].view(torch.int16)[torch.rand(64, 48) < 0.02] ^= 1
                    weights["b"][torch.rand(31, 7) < 0.5] += 1  # mostly changed: whole
            changes, expected = sharded_changes(), engine_would_send()
            s, version = await asyncio.gather(
                tx.send_weights(list(weights.items()), version=v, changes=changes),
                apply_to_module(held, rx, version=version),
            )
            for name, t in weights.items():
                assert torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)), (v, name)
            assert v == 1 or s.wire_bytes == expected, (v, s.wire_bytes, expected)
            sent.append(s)
        return sent

    try:
        sent = asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()
    assert tx.delta.nbytes == 0  # no mirror on the sender: the shards' copies stand for it
    assert [s.base for s in sent] == [None, 1, 2, 3]
    assert all(0 < s.wire_bytes < s.bytes / 2 for s in sent[1:])
    off = registry.new("shm", is_master=True)
    off.prepare()
    try:
        off.init_process_group(rank=0, world_size=1, master_metadata={})
        with pytest.raises(CheckpointEngineError, match=r"changes=\.\.\.\): this shm engine"):
            asyncio.run(off.send_weights([], version=1, changes={}))
    finally:
        off.finalize()


def test_weights_used_in_place_change_only_at_the_receivers_commit():
    """``share_weights(buffers=2)``: the receiver's parameters become the sender's arena
    tensors (no copy of its own); the sender writes the next version into the other arena
    while the receiver's parameters keep the one they hold, bit for bit, until it commits;
    the sender writes an arena again only after every receiver said it left it."""
    torch.manual_seed(0)
    sent = {"w": torch.randn(300, 17).bfloat16(), "b": torch.randn(33)}
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(300, 17, dtype=torch.bfloat16), requires_grad=False)
    model.b = torch.nn.Parameter(torch.zeros(33), requires_grad=False)
    tx, rx, _ = joined_pair(timeout=3)

    async def run() -> list[float]:
        # two arenas, each tensor 256-byte aligned: two copies of the weights per host
        assert tx.share_weights(sent.items(), buffers=2) == 2 * (10240 + 256)
        committed = {}
        for v in range(1, 5):
            with torch.no_grad():
                for t in sent.values():
                    t += 1
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            stats, (got, version) = await asyncio.gather(
                tx.send_weights(list(sent.items()), version=v), rx.receive_in_place()
            )
            assert version == v and stats.wire_bytes == stats.bytes
            # received, not committed: what the model reads has not moved
            for name, p in model.named_parameters():
                assert torch.equal(p.view(torch.uint8), before[name].view(torch.uint8)), (v, name)
                assert torch.equal(got[name].view(torch.uint8), sent[name].view(torch.uint8))
                assert got[name].data_ptr() != p.data_ptr()
            if v == 4:  # this receiver never commits version 4: it reads version 3's arena
                break
            for name, p in model.named_parameters():  # the commit: a pointer swap each
                p.data = got[name]
            rx.released(v)  # it reads no arena older than version v
            committed = {n: p.detach().clone() for n, p in model.named_parameters()}
            for name, p in model.named_parameters():
                assert rx._arena_of(p) is not None  # in the sender's arena: no copy
                assert torch.equal(p.view(torch.uint8), sent[name].view(torch.uint8))
        # so version 5 may not be written over version 3, which the model still reads
        with torch.no_grad():
            sent["b"] += 1
        start = time.perf_counter()
        with pytest.raises(CheckpointEngineTimeout, match="to commit version 4 .weights used"):
            await tx.send_weights(list(sent.items()), version=5)
        for name, p in model.named_parameters():
            assert torch.equal(p.view(torch.uint8), committed[name].view(torch.uint8))
        return [time.perf_counter() - start]

    try:
        waited = asyncio.run(run())
    finally:
        tx.finalize()
        rx.finalize()
    assert waited[0] < 10
