"""Lossless delta updates: ship only the elements that changed since the last update.

The sender keeps a copy of what it last sent (its *mirror*, one model-sized
buffer on the sender's device) and compares each new tensor with it bit for
bit (as integers of the element's width, so NaNs, signed zeros and every dtype
compare exactly). Each tensor then travels in the smallest of three forms:

- ``idx``: the changed positions (``int32``, or ``int64`` past 2**31 elements)
  and their new values: ``k * (4 + itemsize)`` bytes for ``k`` changes;
- ``bits``: a bitmask of the changed positions and their new values:
  ``ceil(n / 8) + k * itemsize`` bytes (smaller above about 3% changed);
- dense: the whole tensor, when neither is smaller.

A delta is computed from, and applied onto, one exact version (the *base*);
the engine sends a delta update only when every receiver says it holds that
version, and dense weights otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from types import ModuleType

import torch

from ._errors import CheckpointEngineError

__all__ = ["DELTA_MODES", "Delta", "DeltaMirror", "check_delta_mode", "decode", "encode"]

DELTA_MODES = ("off", "auto", "on")
AUTO_GIVE_UP = 0.5
"""``delta="auto"`` stops comparing (and frees the mirror) after a delta update
whose bytes were more than this share of the dense update's, or that took longer
than the last dense update (finding the changes reads the weights twice over, so
where the link is as fast as memory, shared memory on one host, dense wins)."""

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BLOCK = 1 << 20  # elements compared per step on the CPU: the mask stays in cache
_ALIGN = 8


def check_delta_mode(mode: object) -> str:
    if mode not in DELTA_MODES:
        allowed = ", ".join(repr(m) for m in DELTA_MODES)
        raise ValueError(f"delta: {mode!r} is not allowed; use {allowed}")
    if mode != "off":
        _numpy()  # needed on the CPU by every member: say so when the engine is built
    return mode


def _numpy() -> ModuleType:
    try:
        import numpy
    except ImportError as err:
        raise ImportError(
            "delta updates need numpy (finding changed elements on the CPU): "
            "pip install 'rlwire-ckpt-engine[delta]'"
        ) from err
    return numpy


def _words(tensor: torch.Tensor) -> torch.Tensor | None:
    """A flat integer view of a contiguous tensor's elements, or None for a width we
    do not diff (complex128's 16 bytes)."""
    word = _WORDS.get(tensor.element_size())
    if word is None:
        return None
    flat = tensor.reshape(-1) if tensor.dim() else tensor.reshape(1)
    return flat.view(word)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _diff_cpu(cur: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Changed positions (int64) and values of ``cur`` against ``prev``; ``prev`` becomes ``cur``.

    Block by block so that the mask stays in cache; numpy, because its
    ``flatnonzero`` is several times faster than torch's ``nonzero`` on the CPU.
    """
    np = _numpy()
    c, p = cur.numpy(), prev.numpy()
    mask = np.empty(min(_BLOCK, c.size), dtype=bool)
    positions, values = [], []
    for start in range(0, c.size, _BLOCK):
        cb, pb = c[start : start + _BLOCK], p[start : start + _BLOCK]
        changed = np.flatnonzero(np.not_equal(cb, pb, out=mask[: cb.size]))
        if changed.size:
            v = cb[changed]
            pb[changed] = v
            positions.append(changed + start)
            values.append(v)
    if not positions:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=cur.dtype)
    return torch.from_numpy(np.concatenate(positions)), torch.from_numpy(np.concatenate(values))


def _diff_torch(cur: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`_diff_cpu`, with torch ops (accelerator tensors)."""
    positions = torch.ne(cur, prev).nonzero().view(-1)
    values = cur[positions]
    prev[positions] = values
    return positions, values


def _pack_bits(positions: torch.Tensor, n: int) -> torch.Tensor:
    """A little-endian bitmask (``uint8``, ``ceil(n / 8)`` bytes) with ``positions`` set."""
    if positions.device.type == "cpu":
        np = _numpy()
        mask = np.zeros(n, dtype=bool)
        mask[positions.numpy()] = True
        return torch.from_numpy(np.packbits(mask, bitorder="little"))
    mask = torch.zeros(_round_up(n), dtype=torch.uint8, device=positions.device)
    mask[positions] = 1
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (mask.view(-1, 8) * weights).sum(1, dtype=torch.uint8)[: -(-n // 8)]


def _unpack_bits(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The positions set in a bitmask made by :func:`_pack_bits` (``int64``)."""
    if mask.device.type == "cpu":
        np = _numpy()
        bits = np.unpackbits(mask.numpy(), count=n, bitorder="little")
        return torch.from_numpy(np.flatnonzero(bits))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:n].nonzero().view(-1)


def encode(cur: torch.Tensor, prev: torch.Tensor) -> tuple[str | None, int, torch.Tensor]:
    """The smallest delta form of ``cur`` against ``prev``, which is brought up to ``cur``.

    Args:
        cur: the tensor to send, contiguous.
        prev: the mirror's copy of what was last sent under that name (same
            shape, dtype and device); updated in place.

    Returns:
        ``(format, changed elements, payload)`` with a ``uint8`` payload; format
        None when the dense tensor is no larger (send ``cur`` whole).
    """
    cw, pw = _words(cur), _words(prev)
    if cw is None:  # a width we do not compare: count it as changed everywhere
        prev.copy_(cur)
        return None, cur.numel(), cur
    assert pw is not None  # prev has cur's dtype, so a width we compare
    if cw.numel() == 0:
        return None, 0, cur
    diff = _diff_cpu if cur.device.type == "cpu" else _diff_torch
    positions, values = diff(cw, pw)
    n, k, size = cw.numel(), positions.numel(), cw.element_size()
    index = torch.int32 if n < 2**31 else torch.int64
    idx_head = k * torch.empty(0, dtype=index).element_size()
    bits_head = -(-n // 8)
    dense = n * size
    fmt, head = ("idx", idx_head) if idx_head <= bits_head else ("bits", bits_head)
    total = _round_up(head) + k * size
    if total >= dense:
        return None, k, cur
    payload = torch.empty(total, dtype=torch.uint8, device=cur.device)
    if fmt == "idx":
        payload[:head].view(index).copy_(positions)
    else:
        payload[:head].copy_(_pack_bits(positions, n))
    payload[_round_up(head) :].view(cw.dtype).copy_(values)
    return fmt, k, payload


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
    """The :class:`Delta` in ``payload`` (``uint8``); values may be a view of it."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    word = _WORDS[itemsize]
    n = 1
    for s in shape:
        n *= s
    if changed == 0 and payload.numel() == 0:  # unchanged (its empty chunk may be unaligned)
        device = payload.device
        return Delta(
            tuple(shape),
            dtype,
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=word, device=device),
        )
    if fmt == "idx":
        index = torch.int32 if n < 2**31 else torch.int64
        head = changed * torch.empty(0, dtype=index).element_size()
        positions = payload[:head].view(index).long()
    elif fmt == "bits":
        head = -(-n // 8)
        positions = _unpack_bits(payload[:head], n)
    else:
        raise CheckpointEngineError(f"unknown delta format {fmt!r} in bucket metadata")
    values = payload[_round_up(head) : _round_up(head) + changed * itemsize].view(word)
    if positions.numel() != changed or values.numel() != changed:
        raise CheckpointEngineError(
            f"delta payload holds {positions.numel()} positions and {values.numel()} values, "
            f"metadata says {changed}"
        )
    if changed and not (int(positions[0]) >= 0 and int(positions[-1]) < n):  # ascending
        raise CheckpointEngineError(
            f"delta positions {int(positions[0])}..{int(positions[-1])} are outside a tensor "
            f"of {n} elements"
        )
    return Delta(tuple(shape), dtype, positions, values)


class DeltaMirror:
    """The sender's copy of what it last sent, and the version the receivers hold.

    Extra sender memory: one copy of every tensor sent (the model's bytes),
    on the tensors' device, allocated on the first update.
    """

    def __init__(self, mode: str) -> None:
        self.mode = check_delta_mode(mode)
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self._dense_seconds: float | None = None  # the last dense update's

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
        """A dense send of ``tensor``: the mirror copies it."""
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
        return encode(tensor, kept)

    def finish(
        self, version: int, *, wire: int, dense: int, seconds: float, was_delta: bool
    ) -> None:
        """The update reached every receiver: they now hold ``version``."""
        self.version = version
        if not was_delta:
            self._dense_seconds = seconds
            return
        slower = self._dense_seconds is not None and seconds > self._dense_seconds
        if self.mode == "auto" and (wire > AUTO_GIVE_UP * dense or slower):
            self.mode, self.tensors, self.version = "off", {}, None

    def invalidate(self) -> None:
        """The update failed: receivers may hold anything, the next one is dense."""
        self.version = None
