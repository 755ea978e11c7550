"""The control channel only the group can use: signed store messages, a stranger's refused,
CUDA IPC handles as plain data (no pickle), and a ``filesystem`` root of the job's user alone."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import inspect
import json
import os
import secrets
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ckpt_engine_pipes import first_line  # this folder: pytest puts it on sys.path
from engine_pair import joined_pair
from torch import nn

from rlwire.ckpt_engine import (
    CheckpointEngineAborted,
    CheckpointEngineAuthError,
    CheckpointEngineError,
    apply_to_module,
    registry,
)
from rlwire.ckpt_engine._segments import SHM_DIR, SHM_PREFIX
from rlwire.ckpt_engine._store import SignedStore
from rlwire.ckpt_engine._wire import BucketMeta
from rlwire.ckpt_engine.backends._shm import attach_segment


def _stranger(metadata: dict) -> dist.TCPStore:
    """A process that can reach the store's port but was never given the metadata's secret."""
    return dist.TCPStore(
        metadata["host"], metadata["port"], is_master=False, timeout=datetime.timedelta(seconds=10)
    )


def test_signed_messages_are_bound_to_the_secret_and_the_key():
    engine = registry.new("shm", is_master=True, bucket_size=4096)
    store = engine.prepare()
    raw = _stranger(store)
    ours = SignedStore(raw, bytes.fromhex(store["secret"]), "shm")
    theirs = SignedStore(raw, b"\0" * 32, "shm")
    assert len(store["secret"]) == 64  # 32 random bytes, hex
    ours.set("meta/0", b"payload")
    assert ours.get("meta/0") == b"payload"
    assert raw.get("meta/0")[SignedStore.TAG :] == b"payload"  # the tag is in front
    with pytest.raises(CheckpointEngineError, match=r"^shm: message 'meta/0' fails authentic"):
        theirs.get("meta/0")
    raw.set("meta/1", raw.get("meta/0"))  # replayed under another key
    with pytest.raises(CheckpointEngineError, match="message 'meta/1' fails authentication"):
        ours.get("meta/1")
    raw.set("meta/2", b"short")  # shorter than a tag
    with pytest.raises(CheckpointEngineError, match="message 'meta/2' fails authentication"):
        ours.get("meta/2")
    engine.finalize()


def test_a_value_over_its_keys_bound_is_refused_before_it_is_hashed(monkeypatch):
    """The libuv server refuses one write over 8 MiB, but ``append`` grows a value past it."""
    METADATA_VALUE_BYTES, CONTROL_VALUE_BYTES = 8 << 20, 64 << 10  # bucket metadata; the rest
    engine = registry.new("shm", is_master=True, bucket_size=4096)
    store = engine.prepare()
    raw = _stranger(store)
    ours = SignedStore(raw, bytes.fromhex(store["secret"]), "shm")
    try:
        ours.set("ack/0/1", b"x" * (CONTROL_VALUE_BYTES - SignedStore.TAG))  # at the bound
        assert ours.get("ack/0/1") == b"x" * (CONTROL_VALUE_BYTES - SignedStore.TAG)
        raw.set("meta/0", b"")
        for _ in range(9):
            raw.append("meta/0", b"\0" * (1 << 20))
        raw.set("ack/0/2", b"y" * (CONTROL_VALUE_BYTES + 1))

        def hashed(key, signed):
            raise AssertionError(f"{key}: hashed before its size was checked")

        monkeypatch.setattr(ours, "verify", hashed)
        for key, size, bound in [
            ("meta/0", 9 << 20, METADATA_VALUE_BYTES),
            ("ack/0/2", CONTROL_VALUE_BYTES + 1, CONTROL_VALUE_BYTES),
        ]:
            with pytest.raises(CheckpointEngineAuthError) as err:
                ours.get(key)
            assert str(err.value) == (
                f"shm: message {key!r} holds {size} bytes, over the {bound} a member writes "
                "there: it was not written by a member of this group; the update is aborted "
                "and the previous version kept"
            )
    finally:
        engine.finalize()


def test_an_aborts_reason_is_cut_to_fit_every_keys_bound():
    engine = registry.new("shm", is_master=True, bucket_size=4096)
    store = engine.prepare()
    raw = _stranger(store)
    secret = bytes.fromhex(store["secret"])
    try:
        SignedStore(raw, secret, "shm").abort("r" * 100_000, also=["ack/0/1"])
        with pytest.raises(CheckpointEngineAborted) as err:
            SignedStore(raw, secret, "shm").get("ack/0/1")
        assert str(err.value) == "shm: the update was aborted: " + "r" * 4096
    finally:
        engine.finalize()


def test_a_receiver_refuses_bucket_metadata_a_stranger_wrote_and_keeps_its_weights():
    torch.manual_seed(0)
    held = nn.Linear(8, 4)
    before = {k: v.clone() for k, v in held.state_dict().items()}
    tx, rx, meta = joined_pair()
    try:
        forged = BucketMeta(index=0, version=7, nbytes=0, entries=[], last=True, base=None)
        _stranger(meta).set("meta/0", forged.to_bytes())  # before the master sends anything
        with pytest.raises(
            CheckpointEngineError,
            match=r"^shm: message 'meta/0' fails authentication: it was not written by a member "
            r"of this group \(wrong or no secret\); the update is aborted and the previous "
            r"version kept$",
        ):
            asyncio.run(apply_to_module(held, rx))
        assert rx.last_version is None
        for name, value in held.state_dict().items():
            assert torch.equal(value, before[name]), name
    finally:
        tx.finalize()
        rx.finalize()


def test_the_master_refuses_an_acknowledgement_a_stranger_wrote():
    """A forged ack would let the master overwrite a slot a receiver is still reading."""
    tx, rx, meta = joined_pair()
    try:
        _stranger(meta).set("ack/0/1", b"1")
        with pytest.raises(CheckpointEngineError, match=r"^shm: message 'ack/0/1' fails auth"):
            asyncio.run(tx.send_weights([("w", torch.ones(4))], version=1))
    finally:
        tx.finalize()
        rx.finalize()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_receiver_needs_the_groups_secret_from_the_masters_metadata(backend):
    tx = registry.new(backend, is_master=True, bucket_size=4096, timeout=5)
    meta = tx.prepare()
    rx = registry.new(backend, bucket_size=4096, timeout=5)
    try:
        without = {k: v for k, v in meta.items() if k != "secret"}
        with pytest.raises(
            CheckpointEngineError,
            match=rf"^{backend}: master_metadata has no valid 'secret' \(the group's key, from "
            r"the master's prepare\(\): pass its metadata whole\)$",
        ):
            rx.init_process_group(rank=1, world_size=2, master_metadata=without)
        with pytest.raises(CheckpointEngineError, match="must hold 'host' and 'port'") as err:
            rx.init_process_group(rank=1, world_size=2, master_metadata={"secret": meta["secret"]})
        assert meta["secret"] not in str(err.value)  # errors never print the key
    finally:
        tx.finalize()
        rx.finalize()


def test_gloo_signs_the_bucket_metadata_it_sends_outside_the_store():
    from rlwire.ckpt_engine.backends import _gloo

    source = inspect.getsource(_gloo.GlooEngine)
    assert 'self._store.sign(f"meta/{meta.index}"' in source  # what _emit broadcasts
    assert 'self._store.verify(f"meta/{seq}"' in source  # what _next accepts
    tx, rx, _ = joined_pair("gloo")
    try:
        weights = [("a", torch.arange(10.0)), ("b", torch.ones(3, dtype=torch.bfloat16))]

        async def once():
            async def take():
                return [(n, t.clone()) async for n, t in rx.receive_weights()]

            return await asyncio.gather(tx.send_weights(weights, version=1), take())

        _, got = asyncio.run(once())
        assert [n for n, _ in got] == ["a", "b"]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(weights, got, strict=True))
    finally:
        tx.finalize()
        rx.finalize()


# --- cuda_ipc handles as plain data --------------------------------------------------

_REBUILD_ARGS = [
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
]


def test_cuda_ipc_handles_travel_as_json_and_rebuild_with_torchs_arguments(monkeypatch):
    """The export is JSON of numbers and base64 strings (nothing a receiver unpickles); the
    import hands torch's rebuild_cuda_tensor exactly what reduce_tensor produced, with this
    process's index of the GPU. Run without CUDA: torch's reduction is stood in for by the
    argument tuple its CUDA branch returns (its layout checked against torch's signature)."""
    import torch.multiprocessing.reductions as reductions

    from rlwire.ckpt_engine.backends import _cuda_ipc

    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters) == _REBUILD_ARGS
    args = (
        torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 3,
        b"\x01handle\xff", 4096, 512, False, b"refs\x00", 17, b"\x02event", True,
    )  # fmt: skip
    monkeypatch.setattr(
        reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, args)
    )
    rebuilt = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: rebuilt.append(a) or "t")
    handle = _cuda_ipc._export(torch.empty(0))
    plain = json.loads(handle)
    assert all(isinstance(v, int | str | bool | list) for v in plain.values()), plain
    assert _cuda_ipc._import(handle, 5) == "t"
    assert rebuilt == [args[:6] + (5,) + args[7:]]  # the device is this process's index
    with pytest.raises(CheckpointEngineError, match=r"^cuda_ipc: a slot handle is malformed"):
        _cuda_ipc._import(json.dumps({**plain, "handle": "not base64!"}), 0)
    with pytest.raises(
        CheckpointEngineError, match=r"^cuda_ipc: a slot handle: dtype 'Tensor' is not"
    ):
        _cuda_ipc._import(json.dumps({**plain, "dtype": "Tensor"}), 0)
    monkeypatch.setattr(
        reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, (nn.Parameter,))
    )
    with pytest.raises(CheckpointEngineError, match="cannot export a Parameter slot"):
        _cuda_ipc._export(torch.empty(0))


# --- what a killed engine leaves in /dev/shm -----------------------------------------


def test_remove_segments_takes_what_a_killed_master_left_and_keeps_a_live_ones():
    import os
    import signal
    import subprocess
    import textwrap

    from rlwire.ckpt_engine import remove_segments
    from rlwire.ckpt_engine._segments import SHM_DIR, SHM_PREFIX

    # A master that prepared its slots (files in /dev/shm until every receiver attaches).
    code = textwrap.dedent(
        """
        import sys, time
        from rlwire.ckpt_engine import registry
        engine = registry.new("shm", is_master=True, bucket_size=4096)
        engine.prepare()
        print("ready", flush=True)
        time.sleep(60)
        """
    )

    def master() -> tuple[subprocess.Popen, list[str]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert first_line(proc, "a master's word that its slots are ready", timeout=120) == "ready"
        mine = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{SHM_PREFIX}{proc.pid}-")]
        assert len(mine) == 2  # the two bucket slots
        return proc, mine

    killed, killed_files = master()
    alive, alive_files = master()
    try:
        killed.send_signal(signal.SIGKILL)  # not reaped yet: a zombie counts as gone
        # (the wait is spent in full on the live one: long enough for the kill to land)
        removed = remove_segments([killed.pid, alive.pid], wait=1.0)
        assert sorted(removed) == sorted(os.path.join(SHM_DIR, n) for n in killed_files)
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in alive_files)
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait()
    assert remove_segments([alive.pid], wait=5.0) == [
        os.path.join(SHM_DIR, n) for n in sorted(alive_files)
    ]


# --- the filesystem backend's root: this user's alone ----------------------------------


def _filesystem(root, *, is_master: bool = True):
    return registry.new("filesystem", root=root, is_master=is_master, timeout=10)


def test_filesystem_makes_a_missing_root_0700_whatever_the_umask(tmp_path):
    import os

    root = tmp_path / "parent" / "weights"
    old = os.umask(0o277)  # would leave the owner without write or search
    try:
        metadata = _filesystem(root).prepare()
    finally:
        os.umask(old)
    assert metadata == {"root": str(root)}
    assert (root.stat().st_mode & 0o777) == 0o700
    assert root.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o777, 0o710], ids=oct)
def test_filesystem_refuses_a_root_open_to_group_or_others(tmp_path, mode):
    import os

    root = tmp_path / "weights"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(CheckpointEngineError) as err:
        _filesystem(root).prepare()
    assert str(err.value) == (
        f"filesystem: root {str(root)!r} is owned by uid {os.geteuid()} with mode {mode:#o}; "
        f"it must be owned by this process's user (uid {os.geteuid()}) and closed to group and "
        "others (whoever can write it can hand the receivers weights): "
        f"chmod 700 {root} (as its owner), or give a root of your own that does not exist yet"
    )
    assert (root.stat().st_mode & 0o777) == mode  # left as it was
    root.chmod(0o700)  # the fix the message names
    assert _filesystem(root).prepare() == {"root": str(root)}


def test_filesystem_refuses_a_root_another_user_owns(tmp_path, monkeypatch):
    import os

    root = tmp_path / "weights"
    root.mkdir(mode=0o700)
    owner = os.geteuid()
    if owner == 0:  # root can give it away for real
        os.chown(root, 65534, -1)
        owner = 65534
    else:  # an unprivileged user cannot: the process runs as someone else instead
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(CheckpointEngineError) as err:
        _filesystem(root).prepare()
    assert f"root {str(root)!r} is owned by uid {owner} with mode 0o700" in str(err.value)
    assert f"(uid {os.geteuid()})" in str(err.value)


def test_filesystem_checks_what_a_symlinked_root_resolves_to(tmp_path):
    import os

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    engine = _filesystem(link)
    assert engine.prepare() == {"root": str(link)}  # the path as given, for other hosts
    assert engine.root == str(private)  # works in the target: a later relink is not followed

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    other = tmp_path / "other"
    other.symlink_to(shared)
    with pytest.raises(CheckpointEngineError) as err:
        _filesystem(other).prepare()
    message = str(err.value)
    assert message.startswith(
        f"filesystem: root {str(other)!r} (-> {str(shared)!r}) is owned by uid {os.geteuid()} "
        "with mode 0o755;"
    )
    assert f"chmod 700 {shared} " in message


def test_a_filesystem_receiver_checks_the_masters_root_too(tmp_path):
    """A receiver reads from the master's root: one opened up after the master prepared
    it is refused at the receiver's join, before anything is read."""
    master = _filesystem(tmp_path / "weights")
    metadata = master.prepare()
    (tmp_path / "weights").chmod(0o777)
    receiver = _filesystem(tmp_path / "mine", is_master=False)
    receiver.prepare()
    with pytest.raises(
        CheckpointEngineError, match=r"root '.*/weights' is owned by uid \d+ with mode 0o777"
    ):
        receiver.init_process_group(rank=1, world_size=2, master_metadata=metadata)


# --- shm: the slot paths in the master's metadata are the caller's word ----------------------


def _segment(tag: str) -> str:
    """A path named as the engine names its segments (a pid nobody has, a random id)."""
    return os.path.join(SHM_DIR, f"{SHM_PREFIX}999999999-{secrets.token_hex(6)}-{tag}")


def test_a_receiver_maps_no_slot_the_backend_did_not_make_and_creates_none(tmp_path):
    """A forged metadata (the store and secret of a real master, the slots elsewhere) is
    refused before anything is mapped: a file outside /dev/shm, one named otherwise, a
    missing one (``torch.from_file`` would create it), a link to a real slot, a short one."""
    tx = registry.new("shm", is_master=True, bucket_size=4096, timeout=10)
    meta = tx.prepare()
    outside = tmp_path / "rlwire-ckpt-shm-1-000000000000-slot0"
    outside.write_bytes(b"\0" * 4096)
    misnamed = os.path.join(SHM_DIR, f"rlwire-test-{secrets.token_hex(6)}")
    missing = _segment("slot0")
    link = _segment("slot1")
    short = _segment("slot0")
    Path(misnamed).write_bytes(b"\0" * 4096)
    os.symlink(meta["slots"][0], link)
    Path(short).write_bytes(b"\0" * 100)
    cases = {
        str(outside): "is refused: not a segment of this backend",
        misnamed: "is refused: not a segment of this backend",
        missing: "cannot open the master's bucket slot .*: No such file or directory",
        link: "cannot open the master's bucket slot .*: Too many levels of symbolic links",
        short: "is refused: 100 bytes, not the 4096 the master announced",
    }
    try:
        for path, message in cases.items():
            rx = registry.new("shm", bucket_size=4096, timeout=10)
            forged = {**meta, "slots": [path, meta["slots"][1]]}
            with pytest.raises(CheckpointEngineError, match=f"^shm: .*{message}"):
                rx.init_process_group(rank=1, world_size=2, master_metadata=forged)
            rx.finalize()
        assert not os.path.exists(missing)  # nothing was created
        assert os.path.getsize(short) == 100  # nor grown
        assert outside.read_bytes() == b"\0" * 4096
    finally:
        tx.finalize()
        for path in (misnamed, link, short):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_segment_of_another_user_or_not_a_file_is_refused():
    fifo, theirs = _segment("arena0"), _segment("arena1")
    os.mkfifo(fifo, 0o600)
    Path(theirs).write_bytes(b"\0" * 64)
    try:
        with pytest.raises(
            CheckpointEngineError, match=r"^shm: the master's shared arena .* not a regular file$"
        ):
            attach_segment(fifo, 64, "shared arena")
        if os.getuid() == 0:  # only root can give a file away
            os.chown(theirs, 65534, 65534)
            with pytest.raises(CheckpointEngineError, match=r"owned by uid 65534, not this"):
                attach_segment(theirs, 64, "shared arena")
        with pytest.raises(CheckpointEngineError, match=r"\('64' bytes\) is refused"):
            attach_segment(theirs, "64", "shared arena")  # type: ignore[arg-type]
    finally:
        for path in (fifo, theirs):
            os.unlink(path)


def test_a_real_segment_is_mapped_shared_read_write():
    path = _segment("slot1")
    Path(path).write_bytes(bytes(range(256)) * 16)
    os.chmod(path, 0o600)
    try:
        mapped = attach_segment(path, 4096, "bucket slot")
        assert mapped.dtype == torch.uint8 and mapped.shape == (4096,)
        assert mapped[:4].tolist() == [0, 1, 2, 3]
        mapped[0] = 77  # shared: the file sees the write
        assert Path(path).read_bytes()[0] == 77
    finally:
        os.unlink(path)
