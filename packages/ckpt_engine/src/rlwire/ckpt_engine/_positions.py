"""How a delta's changed positions travel: gaps of 1 or 2 bytes, or a bitmask; then zstd if asked.

A delta's positions are sorted flat element indices. Two forms, chosen per tensor
by size (so by density):

- ``gaps``: the run of unchanged elements before each change (the first position,
  then ``p[i] - p[i-1] - 1``), each in 1 or 2 bytes (the smaller form); a gap that
  does not fit is marked by the largest value and listed in full after them
  (``uint32``; ``int64`` in a tensor of more than 2**32 elements). At 1% changed the
  gaps average 99 and 8% do not fit a byte: about 1.3 bytes per change, against 4
  for an ``int32`` index; at 0.1%, 2-byte gaps, about 2 bytes.
- ``bits``: a little-endian bitmask, ``ceil(n / 8)`` bytes, smaller above about
  12% changed.

Both run with torch ops on the tensor's device (the bitmask with numpy on the CPU,
where its ``packbits`` is faster). zstd (the ``zstandard`` package)
then compresses a whole payload where the link is slower than compressing:
between hosts, not over loopback or shared memory (``compress="zstd"``).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from ._errors import CheckpointEngineError

COMPRESS_MODES = ("off", "zstd")
ZSTD_LEVEL = 1
"""zstd's fastest standard level: positions and bf16 values gain little from more."""
_ESCAPE = {1: 0xFF, 2: 0xFFFF}  # a gap this large or larger is listed in full
_UNSIGNED = {1: torch.uint8, 2: torch.uint16}
ALIGN = 8


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN` bytes (so that any dtype view is aligned)."""
    return -(-n // ALIGN) * ALIGN


def check_compress(mode: object) -> str:
    if mode not in COMPRESS_MODES:
        allowed = ", ".join(repr(m) for m in COMPRESS_MODES)
        raise ValueError(f"compress: {mode!r} is not allowed; use {allowed}")
    if mode == "zstd":
        _zstd()
    return mode


def _zstd() -> ModuleType:
    try:
        import zstandard
    except ImportError as err:
        raise ImportError(
            "compress='zstd' needs the zstandard package: pip install 'rlwire-ckpt-engine[zstd]'"
        ) from err
    return zstandard


def _numpy() -> ModuleType:
    try:
        import numpy
    except ImportError as err:
        raise ImportError(
            "delta updates need numpy (finding changed elements on the CPU): "
            "pip install 'rlwire-ckpt-engine[delta]'"
        ) from err
    return numpy


# --- bitmask -----------------------------------------------------------------------
def bits_nbytes(n: int) -> int:
    return -(-n // 8)


def pack_bits(positions: torch.Tensor, n: int) -> torch.Tensor:
    """A little-endian bitmask (``uint8``, ``ceil(n / 8)`` bytes) with ``positions`` set."""
    if positions.device.type == "cpu":
        np = _numpy()
        mask = np.zeros(n, dtype=bool)
        mask[positions.numpy()] = True
        return torch.from_numpy(np.packbits(mask, bitorder="little"))
    mask = torch.zeros(bits_nbytes(n) * 8, dtype=torch.uint8, device=positions.device)
    mask[positions] = 1
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (mask.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The positions set in a bitmask made by :func:`pack_bits` (``int64``)."""
    if mask.device.type == "cpu":
        np = _numpy()
        bits = np.unpackbits(mask.numpy(), count=n, bitorder="little")
        return torch.from_numpy(np.flatnonzero(bits))
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:n].nonzero().view(-1)


# --- gaps --------------------------------------------------------------------------
def _gaps(positions: torch.Tensor) -> torch.Tensor:
    gaps = torch.empty_like(positions)
    if positions.numel():
        gaps[0] = positions[0]
        torch.sub(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


@dataclasses.dataclass(slots=True)
class Gaps:
    """Sorted positions as gaps of ``width`` bytes (1 or 2), the ones that do not fit
    (``>= escape``) marked by ``escape`` and listed in full after them (``uint32``, or
    ``int64`` in a tensor of more than 2**32 elements: :func:`escape_dtype`)."""

    gaps: torch.Tensor  # int64, one per position
    width: int
    escaped: torch.Tensor  # int64: the gaps that do not fit, in order
    n: int  # elements of the tensor

    @property
    def nbytes(self) -> int:
        big = escape_dtype(self.n).itemsize
        return align(self.gaps.numel() * self.width) + align(self.escaped.numel() * big)

    def pack(self, out: torch.Tensor) -> None:
        """Write into ``out`` (``uint8``, :attr:`nbytes`)."""
        k, escape = self.gaps.numel(), _ESCAPE[self.width]
        out[: k * self.width].view(_UNSIGNED[self.width]).copy_(self.gaps.clamp(max=escape))
        tail, big = align(k * self.width), escape_dtype(self.n)
        out[tail : tail + self.escaped.numel() * big.itemsize].view(big).copy_(self.escaped)


def escape_dtype(n: int) -> torch.dtype:
    return torch.uint32 if n <= 2**32 else torch.int64


def gaps_form(positions: torch.Tensor, n: int) -> Gaps:
    """The smaller of the 1- and 2-byte gap forms of sorted ``positions`` (``int64``)
    in a tensor of ``n`` elements."""
    gaps = _gaps(positions)
    best = None
    for width in (1, 2):
        escaped = gaps[gaps >= _ESCAPE[width]]
        form = Gaps(gaps, width, escaped, n)
        if best is None or form.nbytes < best.nbytes:
            best = form
        if escaped.numel() == 0:
            break
    assert best is not None
    return best


def unpack_gaps(data: torch.Tensor, width: int, count: int, n: int) -> torch.Tensor:
    """The ``count`` sorted positions (``int64``) that :meth:`Gaps.pack` wrote into ``data``
    (all of it: the gaps, then the escaped ones); each checked below ``n``.

    Raises:
        CheckpointEngineError: ``data`` is not the size its gaps say, or a position is
            outside ``n`` elements.
    """
    if width not in _ESCAPE:
        raise CheckpointEngineError(f"delta positions: gaps of {width} bytes (1 or 2)")
    if data.numel() < count * width:
        raise CheckpointEngineError(
            f"delta positions: {data.numel()} bytes cannot hold {count} gaps of {width} bytes"
        )
    small = data[: count * width].view(_UNSIGNED[width]).to(torch.int64)
    at = (small == _ESCAPE[width]).nonzero().view(-1)
    tail, big = align(count * width), escape_dtype(n)
    size = tail + align(at.numel() * big.itemsize)
    if data.numel() != size:
        raise CheckpointEngineError(
            f"delta positions: {data.numel()} bytes, but {count} gaps of {width} bytes with "
            f"{at.numel()} escaped take {size}"
        )
    escaped = data[tail : tail + at.numel() * big.itemsize].view(big).to(torch.int64)
    if escaped.numel() and int(escaped.min()) < _ESCAPE[width]:
        raise CheckpointEngineError("delta positions: an escaped gap that fits its width")
    small[at] = escaped
    small[1:] += 1
    positions = small.cumsum(0)
    if count and int(positions[-1]) >= n:
        raise CheckpointEngineError(
            f"delta positions reach {int(positions[-1])}, outside a tensor of {n} elements"
        )
    return positions


# --- zstd --------------------------------------------------------------------------
def compress(payload: torch.Tensor) -> torch.Tensor:
    """``payload`` (``uint8``) as one zstd frame that records its size, on the CPU."""
    zstd = _zstd()
    frame = zstd.ZstdCompressor(level=ZSTD_LEVEL).compress(payload.cpu().numpy().tobytes())
    out = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    return out.to(payload.device)


def decompress(frame: torch.Tensor, limit: int) -> torch.Tensor:
    """The bytes in the zstd ``frame`` made by :func:`compress`, at most ``limit`` of them.

    Raises:
        CheckpointEngineError: the frame is not zstd or would hold more than ``limit``.
    """
    zstd = _zstd()
    raw = frame.cpu().numpy().tobytes()
    # python-zstandard ignores max_output_size when the frame states its size: the size a
    # frame claims is checked against the bound before anything is allocated for it
    try:
        declared = zstd.frame_content_size(raw)
    except zstd.ZstdError as err:
        raise CheckpointEngineError(f"delta payload: not a zstd frame ({err})") from err
    if declared < 0:  # unknown (-1): compress() always records the size
        raise CheckpointEngineError(
            "delta payload: a zstd frame that does not record its size; refused (the sender's "
            "frames do)"
        )
    if declared > limit:
        raise CheckpointEngineError(
            f"delta payload: a zstd frame of {declared} bytes, over the {limit} the tensor's "
            "layout allows"
        )
    try:
        data = zstd.ZstdDecompressor().decompress(raw, max_output_size=limit)
    except zstd.ZstdError as err:
        raise CheckpointEngineError(
            f"delta payload: not a zstd frame of at most {limit} bytes ({err})"
        ) from err
    if len(data) != declared:
        raise CheckpointEngineError(
            f"delta payload: a zstd frame stating {declared} bytes holds {len(data)}"
        )
    if not data:  # a frame of nothing (torch.frombuffer refuses an empty buffer)
        return torch.empty(0, dtype=torch.uint8, device=frame.device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(frame.device)
