"""The engine's own rendezvous store, its authenticated messages, and mapping transport
errors to engine errors.

Every value the engine acts on is written with an HMAC-SHA256 over its key and bytes under
the group's secret: 32 random bytes the master draws in ``prepare()`` and hands to the
receivers inside its metadata (the caller's own channel: Ray, verl, vLLM's init info). A
process that can reach the store's port but was not given the metadata can neither forge
nor replay a message (the key is signed with the value); a message that fails the check is
refused, naming its key, and the update is aborted before anything is applied. A value
larger than its key's bound (:func:`value_bound`) is refused the same way before it is
hashed or parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import queue
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

# torch.distributed.TCPStore itself, imported from where it is declared with its types
# (torch.distributed re-exports it without listing it in __all__).
from torch._C._distributed_c10d import TCPStore

from ._errors import (
    CheckpointEngineAborted,
    CheckpointEngineAuthError,
    CheckpointEngineError,
    CheckpointEngineTimeout,
)

__all__ = [
    "SignedStore",
    "blocking",
    "bound_store",
    "connect_store",
    "master_store",
    "peer_errors",
    "value_bound",
]

T = TypeVar("T")

_ABORT = b"\0rlwire-abort\0"
"""What a value written by :meth:`SignedStore.abort` starts with (then the reason)."""

_ABORT_REASON_BYTES = 4 << 10
"""An abort's reason is written cut to this many bytes, so that it fits every key's bound."""

METADATA_VALUE_BYTES = 8 << 20
"""The most a signed value under ``meta/<seq>`` (bucket metadata, tag included) may hold:
torch's libuv TCPStore server, which :func:`bound_store` starts, refuses one write over
8 MiB, so a larger value can only have been grown by ``append``, which no member calls.
Bucket metadata is small beside it (a row of about 100 bytes per tensor chunk)."""

CONTROL_VALUE_BYTES = 64 << 10
"""The most a signed value under any other key may hold: acknowledgements, joins and held
versions (a few bytes), an arena's path and sizes, a slot's CUDA IPC handle (hundreds of
bytes), an abort (its reason cut to 4 KiB)."""


def value_bound(key: str) -> int:
    """The most bytes the signed value of ``key`` may hold, tag included."""
    return METADATA_VALUE_BYTES if key.startswith("meta/") else CONTROL_VALUE_BYTES


def _listening_socket(host: str) -> socket.socket:
    """A socket listening on a free port of ``host``'s address only (torch's own TCPStore
    server listens on every interface whatever host it is given)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as err:
        raise CheckpointEngineError(f"host {host!r}: cannot be resolved ({err})") from None
    if ipaddress.ip_address(str(address[0]).split("%")[0]).is_unspecified:
        sock.close()
        raise CheckpointEngineError(
            f"host {host!r} would listen on every interface; give an address of this machine "
            "that the receivers can reach (127.0.0.1 when they all run here)"
        )
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise CheckpointEngineError(
            f"host {host!r}: cannot listen there ({err}); give an address of this machine "
            "that the receivers can reach"
        ) from None
    return sock


class SignedStore:
    """A TCPStore whose values carry an HMAC-SHA256 of key and value under the group's secret.

    ``set`` signs, ``get`` verifies (``CheckpointEngineError`` naming the key when the tag is
    wrong); ``wait``, ``check`` and ``delete_key`` concern presence only, so a caller that acts
    on a key's presence reads it with :meth:`get` (or :meth:`wait_get`) first. ``raw`` is the
    unsigned store, for torch's own process-group rendezvous.
    """

    TAG = hashlib.sha256().digest_size

    def __init__(self, store: TCPStore, secret: bytes, name: str) -> None:
        self.raw, self.secret, self.name = store, secret, name
        self.aborted: str | None = None
        """Why :meth:`abort` ended this store's waits (None: it did not)."""
        self._waiting: list[str] = []  # the keys a wait_get blocks on now
        self._writes = threading.Lock()  # a set and an abort: one before the other

    @property
    def port(self) -> int:
        return self.raw.port

    def metadata(self, host: str) -> dict[str, Any]:
        """What receivers need to reach and trust this store (the master's ``prepare()``)."""
        return {"host": host, "port": self.port, "secret": self.secret.hex()}

    def tag(self, key: str, value: bytes) -> bytes:
        mac = hmac.new(self.secret, key.encode() + b"\0", hashlib.sha256)
        mac.update(value)  # not concatenated: no second copy of the value
        return mac.digest()

    def sign(self, key: str, value: bytes | str) -> bytes:
        """``value`` with its tag in front (for messages sent outside the store too)."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self.tag(key, data) + data

    def verify(self, key: str, signed: bytes) -> bytes:
        """The value of a signed message, or an error naming ``key`` if it was not signed
        with this group's secret."""
        tag, value = signed[: self.TAG], signed[self.TAG :]
        if len(signed) < self.TAG or not hmac.compare_digest(tag, self.tag(key, value)):
            raise CheckpointEngineAuthError(
                f"{self.name}: message {key!r} fails authentication: it was not written by a "
                "member of this group (wrong or no secret); the update is aborted and the "
                "previous version kept"
            )
        return value

    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` signed; refused once the store is aborted (a message written
        after :meth:`abort` could replace the abort a member waits for)."""
        with self._writes:
            self._check_aborted()
            self.raw.set(key, self.sign(key, value))  # type: ignore[arg-type]  # stub: str only

    def get(self, key: str) -> bytes:
        """The verified value of ``key``; :class:`CheckpointEngineAborted` where it is an
        abort (:meth:`abort`).

        A value over :func:`value_bound` is refused (:class:`CheckpointEngineAuthError`)
        before it is sliced, hashed or parsed. torch's client has copied it by then (its
        buffer, then the Python ``bytes``): TCPStore answers no query of a value's size
        (``check`` and ``wait`` say whether a key exists, ``queue_len`` counts a queue's
        items), so reading a key is receiving all of it; the server's own cap (8 MiB a
        write) does not bound a value grown by ``append``. What this code allocates after
        is bounded."""
        signed = self.raw.get(key)
        bound = value_bound(key)
        if len(signed) > bound:
            raise CheckpointEngineAuthError(
                f"{self.name}: message {key!r} holds {len(signed)} bytes, over the {bound} "
                "a member writes there: it was not written by a member of this group; the "
                "update is aborted and the previous version kept"
            )
        value = self.verify(key, signed)
        if value.startswith(_ABORT):
            reason = value[len(_ABORT) :].decode(errors="replace")
            raise CheckpointEngineAborted(f"{self.name}: the update was aborted: {reason}")
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.raw.wait(keys, timeout)

    def wait_get(self, keys: list[str], timeout: datetime.timedelta) -> list[bytes]:
        """Wait for ``keys`` and return their verified values; ended at once by
        :meth:`abort` (:class:`CheckpointEngineAborted`)."""
        self._waiting = list(keys)  # before the check: an abort after it sees the keys
        try:
            self._check_aborted()
            if keys:
                self.raw.wait(keys, timeout)
            return [self.get(key) for key in keys]
        finally:
            self._waiting = []

    def _check_aborted(self) -> None:
        if self.aborted is not None:
            raise CheckpointEngineAborted(f"{self.name}: the update was aborted: {self.aborted}")

    def abort(self, reason: str, *, also: Iterable[str] = ()) -> None:
        """End this store's waits and refuse its writes from now on, from any thread: the
        keys a :meth:`wait_get` blocks on now, and ``also`` (keys other members may wait
        for), are written with a signed abort, through a connection of their own (the
        waiting thread holds the store's); each waiter then raises
        :class:`CheckpointEngineAborted` with ``reason``. Only a member holding the secret
        can abort, as only one can write."""
        with self._writes:
            if self.aborted is None:
                self.aborted = reason
            keys = list(dict.fromkeys([*self._waiting, *also]))
            if not keys:
                return
            timeout = datetime.timedelta(seconds=30)
            with peer_errors(f"{self.name}: aborting the update", 30):
                other = TCPStore(self.raw.host, self.raw.port, is_master=False, timeout=timeout)
                for key in keys:
                    signed = self.sign(key, _ABORT + reason.encode()[:_ABORT_REASON_BYTES])
                    other.set(key, signed)  # type: ignore[arg-type]  # stub: str only

    def check(self, keys: list[str]) -> bool:
        return self.raw.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.raw.delete_key(key)


def bound_store(host: str, timeout: float) -> TCPStore:
    """A TCPStore served by this process on a free port (``store.port``) of ``host``'s
    address only: loopback when ``host`` is (every member on this machine), the interface
    named otherwise; a wildcard (``0.0.0.0``, ``::``: every interface) is refused.
    Unsigned: for torch's own rendezvous
    (``torch.distributed.init_process_group(store=...)``), whose values torch reads as they
    are; a process that reaches the port could write them, as it could reach gloo's own
    peer connections, which carry no key either: on a cluster both belong on a private
    network. The engine's messages go through :func:`master_store`, which signs them."""
    sock = _listening_socket(host)
    port = sock.getsockname()[1]
    return TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),  # the store owns the descriptor from here
        use_libuv=True,
    )


def master_store(host: str, timeout: float, name: str) -> SignedStore:
    """A :func:`bound_store` whose values a fresh secret signs."""
    return SignedStore(bound_store(host, timeout), secrets.token_bytes(32), name)


def connect_store(meta: dict[str, Any], timeout: float, name: str) -> SignedStore:
    try:
        host, port = meta["host"], int(meta["port"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointEngineError(
            f"master_metadata must hold 'host' and 'port' (from the master's prepare()); "
            f"got {sorted(meta) if isinstance(meta, dict) else meta!r}"
        ) from None
    try:
        secret = bytes.fromhex(meta["secret"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointEngineError(
            f"{name}: master_metadata has no valid 'secret' (the group's key, from the "
            "master's prepare(): pass its metadata whole)"
        ) from None
    with peer_errors(f"connecting to the master's store at {host}:{port}", timeout):
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return SignedStore(store, secret, name)


@contextlib.contextmanager
def peer_errors(what: str, timeout: float) -> Iterator[None]:
    """Turn a transport failure (a stalled or dead peer) into ``CheckpointEngineTimeout``."""
    try:
        yield
    except CheckpointEngineError:
        raise
    # DistError subclasses RuntimeError; TimeoutError is an OSError.
    except (RuntimeError, OSError, queue.Empty, queue.Full) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointEngineTimeout(
            f"{what}: no answer within {timeout:g} s or the peer failed ({first})"
        ) from err


async def blocking(fn: Callable[[], T], what: str, timeout: float) -> T:
    """Run a blocking transport call off the event loop, translating peer failures."""
    with peer_errors(what, timeout):
        return await asyncio.to_thread(fn)
