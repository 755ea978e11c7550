"""``shm``: same host, POSIX shared memory with two bucket slots; control over the store."""

from __future__ import annotations

import contextlib
import datetime
import json
import mmap
import os
import re
import secrets
import shutil
import stat
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .._control import StoreControlledEngine
from .._errors import CheckpointEngineError
from .._segments import SHM_DIR, SHM_PREFIX
from .._store import blocking
from .._wire import ALIGN, BucketMeta

__all__ = ["SHM_PREFIX", "ShmEngine", "attach_segment"]

_SEGMENT = re.compile(re.escape(SHM_PREFIX) + r"\d+-[0-9a-f]{12}-(?:slot[01]|arena\d+)")
"""A segment's file name (:meth:`ShmEngine._create_slots`, :meth:`ShmEngine.share_weights`)."""


def _map(path: str, size: int) -> torch.Tensor:
    """The master's own new segment, mapped shared (it made the file: ``_create``)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def attach_segment(path: Any, size: int, what: str, *, writable: bool = True) -> torch.Tensor:
    """Map a segment the master made, shared, as ``size`` uint8 elements.

    ``writable=False`` (a receiver's bucket slots and shared arenas: every receiver reads
    the same pages): mapped ``PROT_READ`` from an ``O_RDONLY`` descriptor, so a stray write
    from this process is a fault (SIGSEGV, the receiver dies) instead of a change every
    other receiver reads. torch has no read-only tensors: the tensor does not say so itself.

    The path comes from the master's metadata, which is as trustworthy as whoever handed it
    over (a vLLM server's init route: any caller on the host). So only a file this backend
    makes is mapped: directly in ``/dev/shm``, named as the engine names its segments, a
    regular file (a symbolic link is not followed), owned by this process's user, of exactly
    ``size`` bytes; nothing is created or resized (``torch.from_file`` would create a missing
    file and grow a short one).

    Raises:
        CheckpointEngineError: one line naming the path and what is wrong with it.
    """
    name = os.path.basename(path) if isinstance(path, str) else ""
    if (
        not isinstance(path, str)
        or os.path.dirname(path) != SHM_DIR
        or not _SEGMENT.fullmatch(name)
        or isinstance(size, bool)
        or not isinstance(size, int)
        or size < 1
    ):
        raise CheckpointEngineError(
            f"shm: the master's {what} {path!r} ({size!r} bytes) is refused: not a segment of "
            f"this backend (a file {SHM_DIR}/{SHM_PREFIX}<pid>-<id>-slot<n> or -arena<n>, of "
            "a positive size)"
        )
    try:  # O_NOFOLLOW: a link is refused; O_NONBLOCK: a FIFO does not block the open
        mode = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise CheckpointEngineError(
            f"shm: cannot open the master's {what} {path}: {err.strerror} (it must be an "
            "existing regular file, not a link)"
        ) from None
    try:
        info = os.fstat(fd)
        wrong = None
        if not stat.S_ISREG(info.st_mode):
            wrong = "not a regular file"
        elif info.st_uid != os.getuid():
            wrong = f"owned by uid {info.st_uid}, not this process's user ({os.getuid()})"
        elif info.st_size != size:
            wrong = f"{info.st_size} bytes, not the {size} the master announced"
        if wrong is not None:
            raise CheckpointEngineError(f"shm: the master's {what} {path} is refused: {wrong}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mapped = mmap.mmap(fd, size, prot=prot)  # MAP_SHARED; outlives the descriptor
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only is what was asked for: no warning about it
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping alive


def _create(path: str, size: int) -> None:
    """A new file of ``size`` bytes that only this user can read or write (0600), refused if
    the name exists (``O_EXCL``: never someone else's file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _check_room(size: int, what: str) -> None:
    """Shared memory is a RAM-backed file system: writing past its free space kills the
    process (SIGBUS), so a segment that cannot fit is refused before it is made."""
    free = shutil.disk_usage(SHM_DIR).free
    if size > free:
        raise CheckpointEngineError(
            f"shm: {what} needs {size} bytes in {SHM_DIR} but {free} are free; enlarge it "
            "(docker: --shm-size), choose a smaller bucket_size, or use the gloo backend"
        )


class ShmEngine(StoreControlledEngine):
    """Double-buffered shared-memory buckets on one host.

    The master packs bucket ``i`` into slot ``i % 2`` while receivers copy out
    of the other slot; metadata and acknowledgements go through the master's
    TCPStore (see :class:`~rlwire.ckpt_engine._control.StoreControlledEngine`).
    The segment files are unlinked as soon as every receiver has mapped them,
    so nothing is left in ``/dev/shm`` even if a process is killed later.

    Args:
        host: address of the master's store (receivers are on the same host).
    """

    name = "shm"
    zero_copy = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._paths: list[str] = []
        self._token = ""
        # master: [arena tensor, file path or "" once unlinked]; receivers: mapped arenas
        self._arenas: list[list[Any]] = []
        self._mapped: dict[int, torch.Tensor] = {}
        self._double: _Double | None = None  # master: share_weights(buffers=2)
        self._double_mapped = False  # receiver: it mapped such an arena
        self._keep_views = False  # receiver: inside receive_in_place

    def _create_slots(self) -> dict[str, Any]:
        self._token = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self._paths = [os.path.join(SHM_DIR, f"{self._token}-slot{i}") for i in range(2)]
        _check_room(2 * self.bucket_size, "two bucket slots")
        for path in self._paths:
            _create(path, self.bucket_size)
        self.slots = [_map(p, self.bucket_size) for p in self._paths]
        return {"slots": list(self._paths)}

    def _attach_slots(self, master_metadata: dict[str, Any]) -> None:
        paths = master_metadata.get("slots")
        if not isinstance(paths, list) or len(paths) != 2:
            raise CheckpointEngineError(
                f"shm: the master's metadata must name its two bucket slots; got {paths!r}"
            )
        # read-only, as the arenas: a receiver only reads its buckets (unpacked, verified,
        # decoded, copied out), and a stray write must not reach what the others read
        self.slots = [
            attach_segment(p, self.bucket_size, "bucket slot", writable=False) for p in paths
        ]

    def _all_attached(self) -> None:
        self._unlink_slots()

    def _unlink_slots(self) -> None:
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._paths = []

    def _release_slots(self) -> None:
        self._unlink_slots()
        for entry in self._arenas:
            if entry[1]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry[1])
        self._arenas, self._mapped, self._double = [], {}, None
        super()._release_slots()

    # --- zero-copy sender: tensors living in a shared arena ------------------------------
    def share_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, buffers: int = 1
    ) -> int:
        """Move the master's CPU tensors into shared memory once, so updates copy them once.

        ``buffers=2``: weights used in place on one host. Two arenas with the weights'
        layout are laid out and the caller's tensors stay theirs; each ``send_weights``
        copies the weights into the arena the receivers do not read (waiting, within
        ``timeout``, until every receiver committed the version before), so a receiver
        may keep the arena's tensors as its own parameters
        (:meth:`receive_in_place`): no copy per receiver, and nothing it reads changes
        until it commits the next version and says so (:meth:`released`). Memory: two
        copies of the weights in ``/dev/shm`` per host, whatever the receivers' number.
        Dense updates only (a delta would apply onto the arena's older version).

        Each tensor's data moves into a new shared arena (``tensor.data`` is
        swapped: parameter objects keep their identity, optimizers and hooks
        keep working). From then on ``send_weights`` sends these tensors
        without packing them: receivers read them in place, one copy per
        receiver instead of two. The trainer must not modify them while a
        ``send_weights`` is in flight (it returns only after every receiver
        consumed the update). Bucket checksums do not cover shared tensors.

        Returns:
            Bytes moved into the arena.

        Raises:
            CheckpointEngineError: not the master, not prepared, or a non-CPU tensor.
        """
        if not self.is_master or self._store is None:
            raise CheckpointEngineError("share_weights: only the master, after prepare()")
        if buffers not in (1, 2):
            raise ValueError(f"buffers: {buffers!r} is not allowed; use 1 or 2")
        if buffers == 2:
            return self._lay_out_double(weights)
        tensors: dict[int, torch.Tensor] = {}
        for name, tensor in weights:
            _check_plain_cpu(name, tensor)
            tensors.setdefault(id(tensor), tensor)
        offsets, total = [], 0
        for t in tensors.values():
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        _, arena = self._new_arena(max(total, 1), double=False)
        for t, off in zip(tensors.values(), offsets, strict=True):
            view = arena[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
        return total

    def _new_arena(self, size: int, double: bool) -> tuple[int, torch.Tensor]:
        _check_room(size, "share_weights")
        index = len(self._arenas)
        path = os.path.join(SHM_DIR, f"{self._token}-arena{index}")
        _create(path, size)
        arena = _map(path, size)
        self._arenas.append([arena, path])
        assert self._store is not None
        self._store.set(f"arena/{index}", json.dumps([path, size, double]))
        return index, arena

    def _lay_out_double(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.delta.enabled:
            raise CheckpointEngineError(
                "share_weights(buffers=2) sends dense updates only (a delta would apply onto "
                "the older version the other arena holds); build the engine with delta='off'"
            )
        layout, total = [], 0
        for name, tensor in weights:
            _check_plain_cpu(name, tensor)
            nbytes = tensor.numel() * tensor.element_size()
            layout.append((name, total, nbytes, tuple(tensor.shape), tensor.dtype))
            total += -(-nbytes // ALIGN) * ALIGN
        views = []
        for _ in range(2):
            _, arena = self._new_arena(max(total, 1), double=True)
            views.append(
                {
                    name: arena[off : off + nbytes].view(dtype).view(shape)
                    for name, off, nbytes, shape, dtype in layout
                }
            )
        self._double = _Double(views)
        return 2 * total

    async def _send(self, weights: Any, version: int) -> Any:
        double = getattr(self, "_double", None)
        if double is None:
            return await super()._send(weights, version)
        if double.spoiled is not None:
            raise CheckpointEngineError(double.spoiled)
        if not double.free:
            # receivers may read this arena until they commit the version in the other one
            previous = double.versions[1 - double.turn]
            assert previous is not None  # sent after the one in this arena
            await self._wait_released(previous)  # consumes the releases: `free` remembers
            double.free = True
        double.published = False
        try:
            stats = await super()._send(double.fill(double.next(), weights), version)
        except BaseException:
            if double.published:  # some receivers may hold it, the others the one before
                double.spoiled = (
                    f"shm: the send of version {version} failed after receivers could take it "
                    "from its arena (weights used in place): neither arena can be written "
                    "while some may read it; finalize this engine and join a new group"
                )
            raise  # else no receiver saw it: the next send writes the same arena
        double.sent(version)  # only now: the arena holds `version` for every receiver
        return stats

    async def _emit(self, slot: int, meta: BucketMeta) -> None:
        double = getattr(self, "_double", None)
        if double is not None and meta.last:  # first: a failure inside may follow the set
            double.published = True
        await super()._emit(slot, meta)

    async def _wait_released(self, version: int) -> None:
        keys = [f"released/{version}/{r}" for r in self._receivers]
        timeout = datetime.timedelta(seconds=self.timeout)
        await blocking(
            lambda: self._joined_store.wait_get(keys, timeout),
            f"{self.name}: waiting for every receiver to commit version {version} (weights "
            "used in place: the arena it replaces is written next)",
            self.timeout,
        )
        for key in keys:
            self._joined_store.delete_key(key)

    # --- receivers of weights used in place ----------------------------------------------
    async def receive_in_place(self) -> tuple[dict[str, torch.Tensor], int]:
        """Receive one update from a sender with ``share_weights(buffers=2)``:
        ``({name: tensor in the sender's arena}, version)``. The tensors stay valid and
        unchanged until this receiver calls :meth:`released` with a later version (the
        sender writes that arena again only then): make them the model's parameters at a
        boundary (``param.data = tensor``), then call ``released(version)``."""
        self._keep_views = True
        try:
            got = {name: t async for name, t in self.receive_weights(copy=False)}
        finally:
            self._keep_views = False
        for name, tensor in got.items():
            if not isinstance(tensor, torch.Tensor) or self._arena_of(tensor) is None:
                raise CheckpointEngineError(
                    f"receive_in_place: {name!r} did not come from a double-buffered arena "
                    "(the sender needs share_weights(buffers=2))"
                )
        assert self.last_version is not None
        return got, self.last_version

    def released(self, version: int) -> None:
        """This receiver now holds ``version`` and reads no arena of an older one."""
        self._joined_store.set(f"released/{version}/{self.rank}", b"1")

    def _keeps(self, item: torch.Tensor) -> bool:
        return getattr(self, "_keep_views", False) and self._arena_of(item) is not None

    def _after_receive(self, version: int, arenas_read: bool) -> None:
        if arenas_read and not getattr(self, "_keep_views", False) and self._double_mapped:
            self.released(version)  # copied out: this receiver reads the arena no more

    def _arena_of(self, tensor: torch.Tensor) -> int | None:
        ptr = tensor.data_ptr()
        for index, arena in self._mapped.items():
            if arena.data_ptr() <= ptr < arena.data_ptr() + arena.numel():
                return index
        return None

    def _in_arena(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        if not self._arenas or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        ptr = tensor.data_ptr()
        for index, (arena, _) in enumerate(self._arenas):
            base = arena.data_ptr()
            if base <= ptr < base + arena.numel():
                return index, ptr - base
        return None

    def _arena(self, arena: int) -> torch.Tensor:
        if arena not in self._mapped:
            path, size, double = json.loads(self._joined_store.get(f"arena/{arena}"))
            # read-only: a receiver's stray write must not reach what every other one reads
            self._mapped[arena] = attach_segment(path, size, "shared arena", writable=False)
            self._double_mapped = self._double_mapped or bool(double)
            self._joined_store.set(f"arena/{arena}/mapped/{self.rank}", b"1")
        return self._mapped[arena]

    async def _drain(self, last_seq: int) -> None:
        await super()._drain(last_seq)
        # Unlink arena files every receiver has mapped (their mappings stay valid).
        for index, entry in enumerate(self._arenas):
            keys = [f"arena/{index}/mapped/{r}" for r in self._receivers]
            if entry[1] and self._joined_store.check(keys):
                for key in keys:  # verified: a forged one would unlink a file still needed
                    self._joined_store.get(key)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry[1])
                entry[1] = ""


def _check_plain_cpu(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu" or hasattr(tensor, "_local_tensor"):
        raise CheckpointEngineError(
            f"share_weights: {name!r} is not a plain CPU tensor ({tensor.device})"
        )


class _Double:
    """The master's two arenas of weights used in place: the one the next update is written
    into (``turn``; ``free``: no receiver reads it), the version each holds (recorded once
    its send succeeded), and why they cannot be written any more (``spoiled``)."""

    def __init__(self, views: list[dict[str, torch.Tensor]]) -> None:
        self.views = views
        self.versions: list[int | None] = [None, None]
        self.turn = 0
        self.free = True
        self.published = False  # the send in progress published its update
        self.spoiled: str | None = None

    def next(self) -> dict[str, torch.Tensor]:
        return self.views[self.turn]

    def sent(self, version: int) -> None:
        """Every receiver took ``version`` from ``turn``'s arena: the next goes to the other."""
        self.versions[self.turn] = version
        self.turn = 1 - self.turn
        self.free = self.versions[self.turn] is None

    async def fill(self, target: dict[str, torch.Tensor], weights: Any) -> Any:
        """Copy each of ``weights`` into its place in ``target`` and yield that place."""
        async for name, tensor in weights:
            view = target.get(name)
            if view is None or view.shape != tensor.shape or view.dtype != tensor.dtype:
                raise CheckpointEngineError(
                    f"share_weights(buffers=2): {name!r} ({tuple(tensor.shape)} "
                    f"{tensor.dtype}) is not in the layout the arenas were made for"
                )
            view.copy_(tensor)
            yield name, view
