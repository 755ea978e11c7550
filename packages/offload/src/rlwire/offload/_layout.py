"""Where each offloaded tensor goes: host buffers of bounded size, packed in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["ALIGN", "Chunk", "chunked_layout", "host_views"]

ALIGN = 64  # bytes; every tensor in a host buffer starts on a 64-byte boundary


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """One host buffer of an offload: which tensors it holds, at which byte offsets."""

    nbytes: int
    """The buffer's size: the tensors' bytes, each rounded up to ``ALIGN``."""
    indices: tuple[int, ...]
    """Positions of its tensors in the offloaded list."""
    offsets: tuple[int, ...]
    """Byte offset of each of those tensors in the buffer."""


def _aligned_bytes(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def chunked_layout(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> list[Chunk]:
    """Pack ``tensors`` in order into buffers of at most ``chunk_bytes`` (next fit).

    A tensor never straddles two buffers (it is installed as one host view), so
    a tensor larger than ``chunk_bytes`` gets a buffer of its own, of its size.
    The same tensors give the same layout every time: a pool serves later
    cycles (and :func:`prepare_model`'s buffers) by exact fit.
    """
    chunks: list[Chunk] = []
    indices: list[int] = []
    offsets: list[int] = []
    used = 0
    for i, t in enumerate(tensors):
        size = _aligned_bytes(t)
        if indices and used + size > chunk_bytes:
            chunks.append(Chunk(used, tuple(indices), tuple(offsets)))
            indices, offsets, used = [], [], 0
        indices.append(i)
        offsets.append(used)
        used += size
    if indices:
        chunks.append(Chunk(used, tuple(indices), tuple(offsets)))
    return chunks


def host_views(
    block: torch.Tensor, tensors: Sequence[torch.Tensor], chunk: Chunk
) -> list[torch.Tensor]:
    """Views of ``block`` (1-D ``uint8``) shaped like ``chunk``'s tensors, at their offsets."""
    views = []
    for i, off in zip(chunk.indices, chunk.offsets, strict=True):
        t = tensors[i]
        views.append(block[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
    return views
