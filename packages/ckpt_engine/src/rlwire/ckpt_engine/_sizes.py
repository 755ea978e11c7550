"""Byte sizes: parsing ``"512MiB"``/``"2GB"`` and the one default bucket size."""

from __future__ import annotations

import contextlib
import re

import torch

__all__ = ["DEFAULT_BUCKET_SIZE", "parse_bucket_size"]

DEFAULT_BUCKET_SIZE = 256 << 20
"""The bucket size used when none is given: 256 MiB. Large enough that per-bucket
overheads (a control message, a synchronisation) are amortised at tens of GB/s,
small enough that two of them (double buffering) fit beside a large model."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# "auto": this fraction of free memory, clamped to [_AUTO_MIN, _AUTO_MAX].
_AUTO_FRACTION = 0.05
_AUTO_MIN, _AUTO_MAX = 16 << 20, 1 << 30


def _free_bytes(device: torch.device | None) -> int:
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:  # absent off Linux
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * _AUTO_MAX  # unknown: "auto" then resolves to its upper bound


def parse_bucket_size(value: int | str | None, *, device: torch.device | None = None) -> int:
    """Bucket size in bytes from an int, a string like ``"512MiB"``/``"2GB"``, or ``"auto"``.

    ``None`` gives :data:`DEFAULT_BUCKET_SIZE`. ``"auto"`` takes 5% of the free
    memory of ``device`` (host memory for the CPU), clamped to 16 MiB .. 1 GiB.

    Raises:
        ValueError: the value is not a positive size; names what is accepted.
    """
    if value is None:
        return DEFAULT_BUCKET_SIZE
    if isinstance(value, str) and value.strip().lower() == "auto":
        share = int(_free_bytes(device) * _AUTO_FRACTION)
        return max(_AUTO_MIN, min(_AUTO_MAX, share)) // 256 * 256
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _PATTERN.match(value)) and m[2].lower() in _UNITS:
        size = int(float(m[1]) * _UNITS[m[2].lower()])
    if size is None or size < 256:
        raise ValueError(
            f"bucket_size: {value!r} is not allowed; use bytes as an int >= 256, a string "
            "such as '512MiB' or '2GB' (units B, KB, MB, GB, KiB, MiB, GiB), or 'auto'"
        )
    return size
