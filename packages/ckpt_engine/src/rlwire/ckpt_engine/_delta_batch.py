"""Deltas a bucket at a time: compare, encode and decode with a few host synchronisations
per bucket, not a dozen per tensor.

On an accelerator every ``nonzero()`` or ``int(t)`` waits for the device, so the
per-tensor encoder of :mod:`._delta` (about 11 waits and 40 small kernels a tensor)
was 5x slower than a dense copy at 1% changed. Here the sender queues, per tensor,
one comparison into a change mask shared by the bucket and one copy into the mirror
(no wait); then, per bucket: one copy of the per-tensor counts to the host (which form
each tensor takes), one ``nonzero_static`` over the whole mask (its size is known,
so no wait), gaps computed for the whole bucket, and one copy of the escape counts to
the host (the gap forms' sizes). Two waits per bucket, whatever the number of tensors.
The receiver decodes a bucket's deltas with device operations whose checks are
gathered into one flag per tensor, read once per bucket; a payload that fails is
decoded again by :func:`._delta.decode`, whose error names what is wrong.

The wire format is :mod:`._delta`'s: payloads are byte for byte those of
:func:`._delta.pack`. On the CPU there is nothing to wait for, and numpy's
block-by-block comparison reads memory fewer times, so CPU tensors keep
:func:`._delta.encode` and :func:`._delta.decode` (``device=True`` runs this path on
them too: the tests do).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from . import _positions
from ._delta import ZST, Delta, DeltaMirror, _words, decode, delta_layout, encode
from ._errors import CheckpointEngineError
from ._positions import _ESCAPE, _UNSIGNED, align, bits_nbytes, escape_dtype

__all__ = ["DeltaBatch", "DeltaEntry", "Encoded", "decode_many"]

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def _on_device(t: torch.Tensor, device: bool | None) -> bool:
    return device if device is not None else t.device.type != "cpu"


def _host_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an ``int64`` tensor on ``device`` without waiting for it (pinned,
    asynchronous: a plain host-to-device copy waits for the stream)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Encoded(NamedTuple):
    """One tensor of a delta update, as it travels."""

    name: str
    format: str | None
    """The delta's format (``gaps1``, ``gaps2``, ``bits``, each maybe ``.zst``); None: whole."""
    changed: int
    payload: torch.Tensor
    """The delta's bytes (``uint8``), or the whole tensor (its bits)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    """The tensor's bytes."""


@dataclasses.dataclass(slots=True)
class _Pending:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    result: tuple[str | None, int, torch.Tensor] | None  # decided when added
    kept: torch.Tensor | None = None  # the mirror's tensor (holds the new bits once added)
    offset: int = 0  # of the tensor's elements in the bucket's change mask
    n: int = 0
    count: torch.Tensor | None = None  # changed elements (0-d, on the device)


class DeltaBatch:
    """The tensors of one delta bucket, compared with ``mirror`` and encoded together.

    :meth:`add` queues each tensor's comparison and brings the mirror up to it (the
    tensor is not referenced afterwards: a generator may reuse its buffer);
    :meth:`finish` returns every tensor's ``(name, format, changed, payload)`` in the
    order added, as :meth:`DeltaMirror.encode` does one by one. A tensor that travels
    whole has the mirror's copy as its payload (the same bits). ``changed`` is exact on
    this path (the per-tensor CPU path counts a mostly changed tensor as all changed).

    Extra sender memory: a change mask of one byte per element of the bucket's tensors
    (kept by the mirror between buckets), and the positions of the changes.

    Args:
        mirror: the sender's mirror (delta on).
        device: run the per-bucket device path (True), the per-tensor numpy path (False),
            or choose by each tensor's device (None: accelerators batched).
    """

    def __init__(self, mirror: DeltaMirror, *, device: bool | None = None) -> None:
        self.mirror = mirror
        self.device = device
        self.nbytes = 0
        """Bytes of the tensors added since the last :meth:`finish`."""
        self._items: list[_Pending] = []
        self._used = 0  # elements of the change mask in use

    def __len__(self) -> int:
        return len(self._items)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (contiguous), sent under ``name``; no host synchronisation on
        the device path."""
        self.nbytes += tensor.numel() * tensor.element_size()
        mirror, like = self.mirror, (name, tensor.dtype, tuple(tensor.shape))
        kept = mirror.tensors.get(name)
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
            mirror.remember(name, tensor)  # new, or reshaped: whole, all changed
            kept = mirror.tensors.get(name, tensor)
            self._items.append(_Pending(*like, (None, tensor.numel(), kept)))
            return
        if not _on_device(tensor, self.device):
            fmt, k, payload = encode(tensor, kept, compress=mirror.compress)
            self._items.append(_Pending(*like, (fmt, k, kept if fmt is None else payload)))
            return
        cw, pw = _words(tensor), _words(kept)
        if cw is None or pw is None:  # a width we do not compare
            kept.copy_(tensor)
            self._items.append(_Pending(*like, (None, tensor.numel(), kept)))
            return
        n = cw.numel()
        mask = self._mask(n, tensor.device)
        torch.ne(cw, pw, out=mask)
        pw.copy_(cw)
        count = mask.sum(dtype=torch.int64)
        self._items.append(_Pending(*like, None, kept, self._used, n, count))
        self._used += n

    def _mask(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` elements of the bucket's change mask (``bool``), grown as needed."""
        buf = self.mirror.scratch
        need = self._used + n
        if buf is None or buf.device != device or buf.numel() < need:
            grown = torch.empty(
                max(need, 2 * buf.numel() if buf is not None else 0),
                dtype=torch.bool,
                device=device,
            )
            if buf is not None and self._used and buf.device == device:
                grown[: self._used].copy_(buf[: self._used])
            self.mirror.scratch = buf = grown
        return buf[self._used : need]

    def finish(self) -> list[Encoded]:
        """Every queued tensor as it travels, in the order added; the batch is then empty.
        Two host synchronisations on the device path, none if nothing was compared there."""
        items, self._items, self.nbytes = self._items, [], 0
        queued = [it for it in items if it.result is None]
        if queued:
            self._encode(queued)
        self._used = 0
        out = []
        for it in items:
            assert it.result is not None
            fmt, k, payload = it.result
            nbytes = it.dtype.itemsize
            for s in it.shape:
                nbytes *= s
            out.append(Encoded(it.name, fmt, k, payload, it.dtype, it.shape, nbytes))
        return out

    def _encode(self, items: list[_Pending]) -> None:
        mask = self.mirror.scratch
        assert mask is not None
        counts = torch.stack([it.count for it in items if it.count is not None]).tolist()  # wait 1
        # With the counts alone: which tensors travel whole, which need their positions.
        delta: list[tuple[_Pending, int]] = []
        for it, k in zip(items, counts, strict=True):
            assert it.kept is not None
            size, n = it.kept.element_size(), it.n
            least = align(min(align(k), bits_nbytes(n))) + k * size  # a form with no escapes
            if least >= n * size:  # (an empty tensor too)
                it.result = (None, k, it.kept)
                if k:  # its changes must not be among the positions found below
                    mask[it.offset : it.offset + n].zero_()
            elif k == 0:
                it.result = ("gaps1", 0, torch.zeros(0, dtype=torch.uint8, device=mask.device))
            else:
                delta.append((it, k))
        if delta:
            _Positions(self.mirror, mask[: self._used], delta).pack()


class _Positions:
    """The changes of a bucket's delta tensors: positions for all of them at once (their
    total is known, so no wait), gaps and escape counts for all (one wait), then each
    tensor's payload written by slices whose bounds the host knows."""

    def __init__(
        self, mirror: DeltaMirror, mask: torch.Tensor, delta: list[tuple[_Pending, int]]
    ) -> None:
        self.mirror, self.mask, self.delta = mirror, mask, delta
        device = mask.device
        self.starts: list[int] = []
        at = 0
        for _, k in delta:
            self.starts.append(at)
            at += k
        self.found = found = torch.nonzero_static(mask, size=at).view(-1)  # sorted
        # Each change's gap: its distance to the change before in its tensor, less one
        # (the first's: its index in the tensor).
        before = torch.empty_like(found)
        before[1:].copy_(found[:-1])
        before.index_copy_(
            0,
            _host_ints(self.starts, device),
            _host_ints([it.offset - 1 for it, _ in delta], device),
        )
        self.gaps = found - before - 1
        ends = _host_ints([s + k - 1 for s, (_, k) in zip(self.starts, delta, strict=True)], device)
        self.flags = {w: self.gaps >= limit for w, limit in _ESCAPE.items()}
        running = torch.stack([f.cumsum(0)[ends] for f in self.flags.values()]).tolist()  # wait 2
        # per width: each tensor's escapes, and where they start in the bucket's list of them
        self.escapes: dict[int, list[int]] = {}
        self.escape_starts: dict[int, list[int]] = {}
        for w, upto in zip(_ESCAPE, running, strict=True):
            self.escape_starts[w] = [0, *upto[:-1]]
            self.escapes[w] = [b - a for a, b in zip(self.escape_starts[w], upto, strict=True)]
        self._clamped: dict[int, torch.Tensor] = {}
        self._escaped: dict[int, torch.Tensor] = {}

    def pack(self) -> None:
        """Each delta tensor's result, as :func:`._delta.pack` makes it."""
        for j, (it, k) in enumerate(self.delta):
            assert it.kept is not None
            n, size = it.n, it.kept.element_size()
            big = escape_dtype(n).itemsize
            # gaps_form: 1-byte gaps, or 2-byte ones where strictly smaller
            width = 1
            nbytes = align(k) + align(self.escapes[1][j] * big)
            if self.escapes[1][j]:
                two = align(2 * k) + align(self.escapes[2][j] * big)
                if two < nbytes:
                    width, nbytes = 2, two
            bits = bits_nbytes(n)
            fmt, head = (f"gaps{width}", nbytes) if nbytes <= bits else ("bits", bits)
            total = align(head) + k * size
            if total >= n * size:
                it.result = (None, k, it.kept)
                continue
            payload = torch.zeros(total, dtype=torch.uint8, device=self.mask.device)
            if fmt == "bits":
                payload[:head].copy_(self._bitmask(it.offset, n))
            else:
                self._write_gaps(payload, j, width, n)
            words = _words(it.kept)
            assert words is not None
            s = self.starts[j]
            torch.index_select(
                words,
                0,
                self.found[s : s + k] - it.offset,
                out=payload[align(head) :].view(words.dtype),
            )
            it.result = (fmt, k, payload)
            if self.mirror.compress == "zstd":
                frame = _positions.compress(payload)
                if frame.numel() < total:
                    it.result = (fmt + ZST, k, frame)

    def _write_gaps(self, payload: torch.Tensor, j: int, width: int, n: int) -> None:
        s, k = self.starts[j], self.delta[j][1]
        clamped = self._clamped.get(width)
        if clamped is None:
            clamped = self._clamped[width] = self.gaps.clamp(max=_ESCAPE[width])
        payload[: k * width].view(_UNSIGNED[width]).copy_(clamped[s : s + k])
        e = self.escapes[width][j]
        if not e:
            return
        escaped = self._escaped.get(width)
        if escaped is None:
            flag = self.flags[width]
            total = sum(self.escapes[width])
            escaped = self._escaped[width] = self.gaps[
                torch.nonzero_static(flag, size=total).view(-1)
            ]
        big, tail, at = escape_dtype(n), align(k * width), self.escape_starts[width][j]
        payload[tail : tail + e * big.itemsize].view(big).copy_(escaped[at : at + e])

    def _bitmask(self, offset: int, n: int) -> torch.Tensor:
        """The little-endian bitmask of a tensor's changes (``uint8``, ``ceil(n / 8)``)."""
        padded = torch.zeros(bits_nbytes(n) * 8, dtype=torch.uint8, device=self.mask.device)
        padded[:n].copy_(self.mask[offset : offset + n])
        shifts = torch.arange(8, dtype=torch.uint8, device=padded.device)
        return (padded.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


DeltaEntry = tuple[str, int, tuple[int, ...], torch.dtype, torch.Tensor]
"""``(format, changed, shape, dtype, payload)``: one delta as a bucket's metadata and bytes
carry it (the arguments of :func:`._delta.decode`)."""


def decode_many(entries: list[DeltaEntry], *, device: bool | None = None) -> list[Delta]:
    """:func:`._delta.decode` for every delta of a bucket, with one host synchronisation for
    all of their checks (device path), before any is returned.

    Args:
        entries: the bucket's deltas, as :data:`DeltaEntry`.
        device: decode with device operations (True), per tensor with numpy (False), or by
            each payload's device (None: accelerators batched).

    Raises:
        CheckpointEngineError: a payload that does not fit its metadata, with
            :func:`._delta.decode`'s message; nothing is returned then.
    """
    out: list[Delta] = []
    checks: list[tuple[int, torch.Tensor]] = []
    for i, entry in enumerate(entries):
        fmt, changed, _, _, payload = entry
        if not _on_device(payload, device) or (changed == 0 and payload.numel() == 0):
            out.append(decode(*entry))
            continue
        found = _decode_device(*entry)
        if found is None:  # refused on the host: decode says why
            out.append(_refuse(entry))
            continue
        delta, bad = found
        out.append(delta)
        checks.append((i, bad))
    if checks:
        failed = torch.stack([bad for _, bad in checks]).tolist()  # the bucket's one wait
        for (i, _), bad in zip(checks, failed, strict=True):
            if bad:
                _refuse(entries[i])
    return out


def _refuse(entry: DeltaEntry) -> Delta:
    decode(*entry)  # raises, naming the problem
    raise CheckpointEngineError(  # pragma: no cover  # the two decoders disagree
        f"delta payload of {entry[4].numel()} bytes does not fit {entry[0]!r} with {entry[1]} "
        f"changes of a {entry[2]} tensor"
    )


def _decode_device(
    fmt: str, changed: int, shape: tuple[int, ...], dtype: torch.dtype, payload: torch.Tensor
) -> tuple[Delta, torch.Tensor] | None:
    """The delta and a flag (0-d ``bool``, on the device) set if its payload is malformed;
    None if that shows on the host already. No host synchronisation but zstd's."""
    n, itemsize, word = delta_layout(shape, dtype)  # raises as decode does
    form = fmt.removesuffix(ZST)
    if form not in ("gaps1", "gaps2", "bits") or not 0 <= changed <= n:
        return None
    data = _positions.decompress(payload, n * itemsize) if fmt.endswith(ZST) else payload
    k, device = changed, data.device
    head = data.numel() - k * itemsize
    if head < 0:
        return None
    if form == "bits":
        if head != align(bits_nbytes(n)):
            return None
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        bits = ((data[: bits_nbytes(n)].unsqueeze(1) >> shifts) & 1).view(-1)[:n]
        positions = torch.nonzero_static(bits, size=k).view(-1)
        bad = bits.sum() != k
    else:
        width = int(form[-1])
        escape, big = _ESCAPE[width], escape_dtype(n)
        tail = align(k * width)
        rest = head - tail  # the escaped gaps' bytes: align(escaped * big.itemsize)
        if rest < 0 or rest % 8:
            return None
        most = rest // big.itemsize
        least = most - 1 if big.itemsize == 4 and most else most  # (4 escapes pad to 8)
        small = data[: k * width].view(_UNSIGNED[width]).to(torch.int64)
        is_escape = small == escape
        escapes = is_escape.sum()
        bad = (escapes > most) | (escapes < least)
        if most:
            escaped = data[tail : tail + most * big.itemsize].view(big).to(torch.int64)
            rank = (is_escape.cumsum(0) - 1).clamp_(0, most - 1)
            small = torch.where(is_escape, escaped[rank], small)
            real = torch.arange(most, device=device) < escapes
            bad |= ((escaped < escape) & real).any()
        positions = (small + 1).cumsum(0) - 1
        if k:
            bad |= positions[-1] >= n
    values = data[head:].view(word)
    return Delta(tuple(shape), dtype, positions, values), bad
