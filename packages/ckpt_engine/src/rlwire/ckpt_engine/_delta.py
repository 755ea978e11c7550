"""Lossless delta updates: ship only the elements that changed since the last update.

The sender keeps a copy of what it last sent (its *mirror*, one model-sized
buffer on the sender's device) and compares each new tensor with it bit for
bit (as integers of the element's width, so NaNs, signed zeros and every dtype
compare exactly). Each tensor then travels in the smallest of three forms:

- ``gaps1``/``gaps2``: the changed positions as gaps of 1 or 2 bytes
  (``_positions``: about 1.3 bytes per change at 1% changed) and their new values;
- ``bits``: a bitmask of the changed positions (``ceil(n / 8)`` bytes, smaller
  above about 12% changed) and their new values;
- dense: the whole tensor, when neither is smaller.

The values follow the positions at an 8-byte aligned offset, so they are the
payload's last ``k * itemsize`` bytes. With ``compress="zstd"`` a payload that
zstd makes smaller travels compressed (its format ends in ``.zst``).

A delta is computed from, and applied onto, one exact version (the *base*);
the engine sends a delta update only when every receiver says it holds that
version, and dense weights otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from . import _positions
from ._dtypes import WIRE_DTYPES, check_dtype, checked_numel, dtype_name
from ._errors import CheckpointEngineError
from ._positions import _numpy, align, check_compress

__all__ = [
    "DELTA_MODES",
    "ZST",
    "Delta",
    "DeltaMirror",
    "check_delta_mode",
    "decode",
    "delta_layout",
    "diff",
    "encode",
    "pack",
]

DELTA_MODES = ("off", "auto", "on")
AUTO_GIVE_UP = 0.5
"""``delta="auto"`` stops comparing (and frees the mirror) after a delta update
whose bytes were more than this share of the dense update's, or that took longer
than the last dense update (finding the changes reads the weights twice over, so
where the link is as fast as memory, shared memory on one host, dense wins)."""

AUTO_DENSE_ON = ("cuda",)
"""Devices where ``delta="auto"`` sends dense from the first update and keeps no mirror:
there the link is device memory or a GPU interconnect, and a dense copy costs about what
reading the weights and the mirror to find the changes costs (``delta="on"`` still sends
deltas there, encoded a bucket at a time: :mod:`._delta_batch`)."""

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ZST = ".zst"
"""The suffix of a compressed delta's format."""
_BLOCK = 1 << 20  # elements compared per step on the CPU: the mask stays in cache
MOSTLY_CHANGED = 0.5
"""A tensor whose first block (2**20 elements, or all of a smaller one) has more than this
share changed is sent whole and counted as changed everywhere, without finding each
change: an update that changed everything (fp32 weights under Adam) costs one copy into
the mirror, not a comparison that gathers and scatters every element."""


def check_delta_mode(mode: object) -> str:
    if mode not in DELTA_MODES:
        allowed = ", ".join(repr(m) for m in DELTA_MODES)
        raise ValueError(f"delta: {mode!r} is not allowed; use {allowed}")
    if mode != "off":
        _numpy()  # needed on the CPU by every member: say so when the engine is built
    return mode


def _words(tensor: torch.Tensor) -> torch.Tensor | None:
    """A flat integer view of a contiguous tensor's elements, or None for a width we
    do not diff (complex128's 16 bytes)."""
    word = _WORDS.get(tensor.element_size())
    if word is None:
        return None
    flat = tensor.reshape(-1) if tensor.dim() else tensor.reshape(1)
    return flat.view(word)


def _diff_cpu(cur: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Changed positions (int64) and values of ``cur`` against ``prev``; ``prev`` becomes ``cur``.

    Block by block so that the masks stay in cache; numpy, because its
    ``flatnonzero`` is several times faster than torch's ``nonzero`` on the CPU.
    Narrow elements are compared 8 bytes at a time first (a quarter of the mask
    for bf16), then only the words that differ element by element. One thread:
    the comparison reads the weights and the mirror, and a second thread on
    this machine's memory made it slower, not faster.

    None when the first block finds more than :data:`MOSTLY_CHANGED` of its elements
    changed (a delta could not be smaller than the tensor): ``prev`` is then brought up
    to ``cur`` by one copy instead of a comparison that scatters every element.
    """
    np = _numpy()
    c, p = cur.numpy(), prev.numpy()
    per = 8 // c.itemsize
    body = c.size - c.size % per if per > 1 else 0
    found = []
    if body:
        cw, pw = c[:body].view(np.int64), p[:body].view(np.int64)
        for start in range(0, cw.size, _BLOCK // per):
            cb, pb = cw[start : start + _BLOCK // per], pw[start : start + _BLOCK // per]
            words = np.flatnonzero(np.not_equal(cb, pb))
            # (a word holds `per` elements: changed words at half the elements changed)
            if start == 0 and words.size > (1 - (1 - MOSTLY_CHANGED) ** per) * cb.size:
                prev.copy_(cur)
                return None
            new = cb[words]
            inside = np.flatnonzero(np.not_equal(new.view(c.dtype), pb[words].view(c.dtype)))
            pb[words] = new
            at = (words[inside // per] + start) * per + inside % per
            found.append((at, new.view(c.dtype)[inside]))
    for start in range(body, c.size, _BLOCK):
        cb, pb = c[start : start + _BLOCK], p[start : start + _BLOCK]
        changed = np.flatnonzero(np.not_equal(cb, pb))
        if start == 0 and changed.size > MOSTLY_CHANGED * cb.size:
            prev.copy_(cur)
            return None
        new = cb[changed]
        pb[changed] = new
        found.append((changed + start, new))
    if not found:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=cur.dtype)
    positions = np.concatenate([f[0] for f in found])
    return torch.from_numpy(positions), torch.from_numpy(np.concatenate([f[1] for f in found]))


def _diff_torch(cur: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_diff_cpu`, with torch ops (accelerator tensors)."""
    positions = torch.ne(cur, prev).nonzero().view(-1)
    values = cur[positions]
    prev[positions] = values
    return positions, values


def encode(
    cur: torch.Tensor, prev: torch.Tensor, *, compress: str = "off"
) -> tuple[str | None, int, torch.Tensor]:
    """The smallest delta form of ``cur`` against ``prev``, which is brought up to ``cur``.

    Args:
        cur: the tensor to send, contiguous.
        prev: the mirror's copy of what was last sent under that name (same
            shape, dtype and device); updated in place.
        compress: ``"zstd"`` compresses the payload where that makes it smaller
            (its format then ends in ``.zst``).

    Returns:
        ``(format, changed elements, payload)`` with a ``uint8`` payload; format
        None when the dense tensor is no larger (send ``cur`` whole).
    """
    found = diff(prev, cur)
    if found is None:  # mostly changed, or a width we do not compare: whole
        return None, cur.numel(), cur
    return pack(cur, found.positions, found.values, compress=compress)


def pack(
    cur: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, *, compress: str = "off"
) -> tuple[str | None, int, torch.Tensor]:
    """The smallest form of the changes ``positions`` (sorted flat indices, ``int64``) and
    ``values`` (the new elements as integers of their width) that made ``cur``: as
    :func:`encode` returns it (``cur`` itself when whole is no larger)."""
    cw = _words(cur)
    assert cw is not None  # a width we compare (the caller found the changes)
    n, k, size = cw.numel(), positions.numel(), cw.element_size()
    gaps = _positions.gaps_form(positions, n)
    bits_head = _positions.bits_nbytes(n)
    if gaps.nbytes <= bits_head:
        fmt, head = f"gaps{gaps.width}", gaps.nbytes
    else:
        fmt, head = "bits", bits_head
    total = align(head) + k * size
    if total >= n * size:
        return None, k, cur
    payload = torch.zeros(total, dtype=torch.uint8, device=cur.device)
    if fmt != "bits":
        gaps.pack(payload[:head])
    else:
        payload[:head].copy_(_positions.pack_bits(positions, n))
    payload[align(head) :].view(cw.dtype).copy_(values)
    if compress == "zstd" and k:
        frame = _positions.compress(payload)
        if frame.numel() < total:
            return fmt + ZST, k, frame
    return fmt, k, payload


def diff(prev: torch.Tensor, cur: torch.Tensor) -> Delta | None:
    """The changes that make ``prev`` into ``cur`` (same shape and dtype, contiguous),
    compared bit for bit; ``prev`` is brought up to ``cur``. None when they cannot be
    smaller than ``cur`` (more than half of its first block changed, or a width not
    compared): send it whole. What a caller gives ``send_weights(changes=...)``; positions
    are flat indices of ``cur``, so a shard's must be moved to where it sits in the whole
    tensor (add its first element's flat index)."""
    if prev.shape != cur.shape or prev.dtype != cur.dtype:
        raise ValueError(
            f"diff: {tuple(prev.shape)} {prev.dtype} against {tuple(cur.shape)} {cur.dtype}"
        )
    cw, pw = _words(cur), _words(prev)
    if cw is None or pw is None:
        prev.copy_(cur)
        return None
    found = (_diff_cpu if cur.device.type == "cpu" else _diff_torch)(cw, pw)
    if found is None:
        return None
    return Delta(tuple(cur.shape), cur.dtype, *found)


@dataclasses.dataclass(slots=True)
class Delta:
    """The changed elements of one tensor since the receiver's base version.

    ``positions`` (``int64``, flat element indices) and ``values`` (the new
    elements, as integers of the element's width) live on the bucket's device.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    positions: torch.Tensor
    values: torch.Tensor

    @property
    def changed(self) -> int:
        return self.positions.numel()

    def apply_(self, target: torch.Tensor) -> torch.Tensor:
        """Write the changed elements into ``target`` (the base version's tensor), in place.

        Raises:
            CheckpointEngineError: ``target`` has another shape or dtype, or is not contiguous.
        """
        if tuple(target.shape) != self.shape or target.dtype != self.dtype:
            raise CheckpointEngineError(
                f"delta for {self.shape} {self.dtype} applied onto {tuple(target.shape)} "
                f"{target.dtype}"
            )
        if not target.is_contiguous():
            raise CheckpointEngineError("a delta applies onto a contiguous tensor only")
        words = _words(target)
        assert words is not None  # deltas exist only for the widths we compare (decode)
        words.index_copy_(
            0, self.positions.to(words.device), self.values.to(words.device).view(words.dtype)
        )
        return target

    def clone(self) -> Delta:
        """A delta that owns its tensors (one received with ``copy=False`` may be a view
        of the engine's buffer, valid only until the next item)."""
        return Delta(self.shape, self.dtype, self.positions.clone(), self.values.clone())

    def _release(self) -> None:
        # A retained view of the bucket becomes empty, never stale.
        self.positions.set_()  # type: ignore[call-overload]  # stub lacks set_() (empties)
        self.values.set_()  # type: ignore[call-overload]  # stub lacks set_() (empties)


def decode(
    fmt: str, changed: int, shape: tuple[int, ...], dtype: torch.dtype, payload: torch.Tensor
) -> Delta:
    """The :class:`Delta` in ``payload`` (``uint8``); values may be a view of it.

    Raises:
        CheckpointEngineError: a dtype not in :data:`~._dtypes.WIRE_DTYPES`, a shape no
            tensor has, or a payload that does not fit its metadata.
    """
    n, itemsize, word = delta_layout(shape, dtype)
    device = payload.device
    if changed == 0 and payload.numel() == 0:  # unchanged (its empty chunk may be unaligned)
        return Delta(
            tuple(shape),
            dtype,
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=word, device=device),
        )
    form = fmt.removesuffix(ZST)
    if form not in ("gaps1", "gaps2", "bits"):
        raise CheckpointEngineError(f"unknown delta format {fmt!r} in bucket metadata")
    if not 0 <= changed <= n:
        raise CheckpointEngineError(f"delta of {changed} changes in a tensor of {n} elements")
    if fmt.endswith(ZST):  # at most the largest form a delta is sent in (else it went dense)
        payload = _positions.decompress(payload, n * itemsize)
    head = payload.numel() - changed * itemsize  # the values are the payload's tail
    if head < 0 or (form == "bits" and head != align(_positions.bits_nbytes(n))):
        raise CheckpointEngineError(
            f"delta payload of {payload.numel()} bytes cannot hold {changed} {form} changes "
            f"of a tensor of {n} elements"
        )
    if form != "bits":
        positions = _positions.unpack_gaps(payload[:head], int(form[-1]), changed, n)
    else:
        positions = _positions.unpack_bits(payload[: _positions.bits_nbytes(n)], n)
        if positions.numel() != changed:
            raise CheckpointEngineError(
                f"delta bitmask sets {positions.numel()} positions, metadata says {changed}"
            )
    values = payload[head:].view(word)
    return Delta(tuple(shape), dtype, positions, values)


def delta_layout(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int, torch.dtype]:
    """``(elements, element size, word dtype)`` of a delta's tensor, once its dtype is one
    the engine sends (each is 1, 2, 4 or 8 bytes wide) and its shape one a tensor has.

    Raises:
        CheckpointEngineError: ``delta: dtype ...`` or ``delta: shape ...``, naming what is
            allowed.
    """
    if dtype not in _SENT:
        check_dtype(dtype_name(dtype), "delta")
    n = checked_numel(tuple(shape), dtype, "delta")
    return n, dtype.itemsize, _WORDS[dtype.itemsize]


_SENT = frozenset(WIRE_DTYPES.values())


class DeltaMirror:
    """The sender's copy of what it last sent, and the version the receivers hold.

    Extra sender memory: one copy of every tensor sent (the model's bytes),
    on the tensors' device, allocated on the first update.
    """

    def __init__(self, mode: str, *, compress: str = "off") -> None:
        self.mode = check_delta_mode(mode)
        self.compress = check_compress(compress)
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self._dense_seconds: float | None = None  # the last dense update's
        self.scratch: torch.Tensor | None = None
        """The change mask of :class:`~._delta_batch.DeltaBatch` (``bool``, on the weights'
        device), kept between buckets and updates."""
        self.reason: str | None = None
        """Why ``delta="auto"`` sends dense updates from now on (it stopped comparing and
        freed the mirror); None while it may send deltas, and for ``"on"``/``"off"``."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def base_for(self, held: Iterable[int | None]) -> int | None:
        """The version to send a delta against, if every receiver holds the mirror's."""
        held = list(held)
        if self.version is None or not held or any(v != self.version for v in held):
            return None
        return self.version

    def remember(self, name: str, tensor: torch.Tensor) -> None:
        """A dense send of ``tensor``: the mirror copies it (``delta="auto"`` on a device of
        :data:`AUTO_DENSE_ON`: stops comparing instead)."""
        if self.mode == "auto" and tensor.device.type in AUTO_DENSE_ON:
            self._give_up(
                f"auto: sends dense on {tensor.device.type}, where a dense copy costs about what "
                "finding the changes does (delta='on' sends deltas there)"
            )
            return
        kept = self.tensors.get(name)
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
            kept = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            self.tensors[name] = kept
        kept.copy_(tensor)

    def encode(self, name: str, tensor: torch.Tensor) -> tuple[str | None, int, torch.Tensor]:
        """:func:`encode` ``tensor`` against what was last sent as ``name`` (a name not
        sent before, or sent with another shape or dtype, goes dense, all changed)."""
        kept = self.tensors.get(name)
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
            self.remember(name, tensor)
            return None, tensor.numel(), tensor
        return encode(tensor, kept, compress=self.compress)

    def finish(
        self, version: int, *, wire: int, dense: int, seconds: float, was_delta: bool
    ) -> None:
        """The update reached every receiver: they now hold ``version``."""
        self.version = version
        if not was_delta:
            self._dense_seconds = seconds
            return
        if self.mode != "auto":
            return
        if wire > AUTO_GIVE_UP * dense:
            self._give_up(
                f"auto: a delta update sent {wire / max(dense, 1):.0%} of the dense bytes "
                f"(more than {AUTO_GIVE_UP:.0%})"
            )
        elif self._dense_seconds is not None and seconds > self._dense_seconds:
            self._give_up(
                f"auto: a delta update took {seconds:.3f} s, longer than the last dense one "
                f"({self._dense_seconds:.3f} s)"
            )

    def _give_up(self, reason: str) -> None:
        """``delta="auto"`` stops comparing for good and frees the mirror."""
        self.mode, self.tensors, self.version, self.scratch = "off", {}, None, None
        self.reason = reason

    def invalidate(self) -> None:
        """The update failed: receivers may hold anything, the next one is dense."""
        self.version = None
