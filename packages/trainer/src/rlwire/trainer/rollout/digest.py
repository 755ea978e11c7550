"""Weight digests computed on the tensors' own device: what the actor's push and every
rollout engine's ``digest()`` compute, so that ``ckpt_engine.digest`` can compare them."""

from __future__ import annotations

import torch

__all__ = [
    "WeightsDigest",
    "digest_of_parts",
    "first_difference",
    "weights_digest",
    "weights_digest_parts",
]


_ROW = 4096
"""Elements per row of the fingerprint's weight grid (see :class:`WeightsDigest`)."""
_LANES = 2
"""Independent 64-bit sums per tensor."""
_CHUNK = {"cpu": 1 << 16}
"""Elements reduced at a time, by device type (default :data:`_CHUNK_DEFAULT`): on the host
a chunk's temporaries stay in cache (100M elements, one core: 0.55 s in 64 Ki-element
chunks, 1.8 s in 4 Mi ones); on an accelerator fewer, larger kernels."""
_CHUNK_DEFAULT = 1 << 22
_MASK30 = (1 << 30) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch multiplies with (wrapping)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` sign-extends)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 ``x``, element-wise (multiplications wrap)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def _column_weights(device: torch.device) -> torch.Tensor:
    """``(_LANES, _ROW)`` int64: per lane, distinct odd weights below ``2**31`` (a bijection
    of 30 bits: odd multiplications and xor-shifts, exact in int64)."""
    lanes = torch.arange(_LANES, dtype=torch.int64, device=device)[:, None]
    seeds = (lanes * 0x1B873593 + 0x2545F491) & _MASK30  # made here: no copy from the host
    x = torch.arange(_ROW, dtype=torch.int64, device=device) ^ seeds
    x = (x * 0x2C1B3C6D) & _MASK30
    x = x ^ (x >> 15)
    x = (x * 0x297A2D39) & _MASK30
    x = x ^ (x >> 13)
    return 2 * x + 1


def _row_weights(rows: int, device: torch.device) -> torch.Tensor:
    """``(rows, _LANES)`` int64: pseudo-random odd weights of rows ``0 .. rows - 1``."""
    index = torch.arange(rows * _LANES, dtype=torch.int64, device=device).view(rows, _LANES)
    return _splitmix(index) | 1


class _Grid:
    """The weights of one device: the columns', and the rows' grown on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.columns = _column_weights(device)
        self.columns_bf16 = self.columns << 16
        """For bf16 bit patterns ``h`` (int16): fp32's are ``h * 2**16``, exactly."""
        self._rows = _row_weights(0, device)

    def rows(self, count: int) -> torch.Tensor:
        if self._rows.shape[0] < count:
            self._rows = _row_weights(max(count, 2 * self._rows.shape[0]), self.device)
        return self._rows[:count]


def _fingerprint(tensor: torch.Tensor, grid: _Grid, chunk: int) -> torch.Tensor:
    """``(_LANES,)`` int64 on ``tensor``'s device (see :class:`WeightsDigest`); queued only,
    nothing read back."""
    flat = tensor.detach().reshape(-1)
    total = flat.numel()
    rows = grid.rows(-(-total // _ROW))
    bf16 = flat.dtype == torch.bfloat16  # no conversion pass: its bits, widened by weights
    columns = grid.columns_bf16 if bf16 else grid.columns
    out = torch.zeros(_LANES, dtype=torch.int64, device=flat.device)
    for start in range(0, total, chunk):
        part = flat[start : start + chunk]
        bits = part.view(torch.int16) if bf16 else part.to(torch.float32).view(torch.int32)
        first, whole = start // _ROW, bits.numel() // _ROW
        if whole:  # exact products below 2**62 (int64); the sums wrap
            sums = (bits[: whole * _ROW].view(whole, 1, _ROW) * columns).sum(-1)
            out += (sums * rows[first : first + whole]).sum(0)
        if bits.numel() > whole * _ROW:  # the tensor's last row, partial
            tail = bits[whole * _ROW :]
            out += (tail * columns[:, : tail.numel()]).sum(-1) * rows[first + whole]
    return out


class WeightsDigest:
    """A digest of ``(name, tensor)`` pairs, independent of their order and of the dtype
    the values are held in (each value is taken as fp32: a bf16 engine and an fp32 copy of
    the same values agree), computed on the tensors' own device.

    Each tensor's fingerprint is two 64-bit sums over its fp32 bit patterns ``v_i`` (int32,
    flat row-major position ``i``): ``sum_i v_i * c[i % 4096] * r[i // 4096] mod 2**64``,
    with per lane distinct odd column weights ``c`` below ``2**31`` and pseudo-random odd
    row weights ``r``. Integer sums that wrap are exact whatever the order of reduction, so
    any device, chunking or kernel gives the same bits. Any one element changed changes
    both sums (the change, below ``2**63`` in size, times an odd number is never 0 mod
    ``2**64``), and so does exchanging two elements of one row; other changes collide with
    probability about ``2**-64`` per lane. The sign of zero counts, as in fp32 bytes.

    :meth:`add` only queues the reductions (a few kernels per ``4 Mi`` elements; on the
    host in ``64 Ki`` chunks that stay in cache): the fingerprint, ``(2,)`` int64, stays on
    the tensor's device, with no host synchronisation; temporaries are about 28 bytes per
    element of one chunk. :meth:`hexdigest` copies them to the host once per device and
    hashes the names, shapes and fingerprints, sorted by name, with SHA-256.

    Args:
        chunk: elements reduced at a time (a multiple of 4096; the result does not depend
            on it); by default 64 Ki on the host, 4 Mi on an accelerator.
    """

    def __init__(self, *, chunk: int | None = None) -> None:
        if chunk is not None and (chunk <= 0 or chunk % _ROW):
            raise ValueError(f"chunk: {chunk} is not allowed; use a positive multiple of {_ROW}")
        self._chunk = chunk
        self._parts: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        self._grids: dict[torch.device, _Grid] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor``'s fingerprint under ``name`` (nothing waits on the device)."""
        device = tensor.device
        grid = self._grids.get(device)
        if grid is None:
            grid = self._grids[device] = _Grid(device)
        chunk = self._chunk or _CHUNK.get(device.type, _CHUNK_DEFAULT)
        self._parts.append((name, tuple(tensor.shape), _fingerprint(tensor, grid, chunk)))

    def fingerprints(self) -> dict[str, torch.Tensor]:
        """Each name's ``(2,)`` int64 fingerprint, on its tensor's device (the last one
        added under a name)."""
        return {name: fingerprint for name, _, fingerprint in self._parts}

    def parts(self) -> dict[str, str]:
        """Each name's ``"[shape]:fingerprint"`` (hex): the only wait, one copy to the host
        per device. What :meth:`hexdigest` hashes, and what names the first tensor two
        digests disagree on (:func:`first_difference`)."""
        values: list[list[int]] = [[] for _ in self._parts]
        for device in {f.device for _, _, f in self._parts}:
            mine = [i for i, (_, _, f) in enumerate(self._parts) if f.device == device]
            host = torch.stack([self._parts[i][2] for i in mine]).cpu().tolist()
            for i, lanes in zip(mine, host, strict=True):
                values[i] = lanes
        return {
            name: f"{list(shape)}:" + "".join(f"{v & (1 << 64) - 1:016x}" for v in lanes)
            for (name, shape, _), lanes in zip(self._parts, values, strict=True)
        }

    def hexdigest(self) -> str:
        """SHA-256 over every ``(name, shape, fingerprint)``, sorted (:func:`digest_of_parts`
        of :meth:`parts`)."""
        return digest_of_parts(self.parts())


def digest_of_parts(parts: dict[str, str]) -> str:
    """The digest of :meth:`WeightsDigest.parts`: SHA-256 over ``name:part;``, sorted."""
    import hashlib

    whole = hashlib.sha256()
    for line in sorted(f"{name}:{part}" for name, part in parts.items()):
        whole.update(f"{line};".encode())
    return whole.hexdigest()


def first_difference(ours: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first name, in sorted order, whose part differs between two
    :meth:`WeightsDigest.parts` (or that one of them lacks), or None when they agree."""
    for name in sorted(ours.keys() | theirs.keys()):
        if ours.get(name) != theirs.get(name):
            return name
    return None


def weights_digest(items) -> str:
    """The :class:`WeightsDigest` of ``(name, tensor)`` pairs: what every rollout engine's
    ``digest`` and the actor's push compute, so that they compare equal."""
    return digest_of_parts(weights_digest_parts(items))


def weights_digest_parts(items) -> dict[str, str]:
    """:meth:`WeightsDigest.parts` of ``(name, tensor)`` pairs."""
    digest = WeightsDigest()
    for name, tensor in items:
        digest.add(name, tensor)
    return digest.parts()
