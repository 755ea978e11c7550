"""The dtypes and shapes a tensor may have on the wire (bucket metadata, delta entries, the
filesystem backend's manifest), checked on both ends: a sender refuses a tensor of another
dtype before anything is sent, a receiver refuses metadata that names one, or a shape no
tensor can have, before anything is allocated from it."""

from __future__ import annotations

import torch

from ._errors import CheckpointEngineError

__all__ = ["MAX_TENSOR_BYTES", "WIRE_DTYPES", "check_dtype", "checked_numel", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


WIRE_DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}
"""The dtypes the engine sends, by the name the metadata gives them: model weights' float and
integer types, bool, and the fp8 types (``float8_e4m3fn``: :mod:`._fp8`'s block-quantized
weights; ``float8_e5m2``). Each is 1, 2, 4 or 8 bytes wide, the widths a delta compares.
Not sent: complex types (16-byte elements a delta does not compare), quantized (``qint8``,
``quint4x2``: a tensor and its scales, not plain bytes) and bit types (``bits8``)."""

MAX_TENSOR_BYTES = 2**63 - 1
"""A shape whose elements take more bytes than this is refused: torch describes no tensor
larger (its sizes, strides and byte counts are 64-bit signed integers)."""


def check_dtype(name: object, what: str) -> torch.dtype:
    """The dtype named ``name`` if it is one of :data:`WIRE_DTYPES`.

    Raises:
        CheckpointEngineError: ``{what}: dtype ... is not allowed``, listing the allowed ones.
    """
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CheckpointEngineError(
            f"{what}: dtype {_shown(name)} is not allowed; the engine sends "
            + ", ".join(WIRE_DTYPES)
        )
    return dtype


def checked_numel(shape: tuple[object, ...], dtype: torch.dtype, what: str) -> int:
    """The number of elements of a tensor of ``shape`` and ``dtype``, once the shape is one a
    tensor can have: each dimension an integer in ``[0, 2**63)``, and its non-empty
    dimensions' product times the element size at most :data:`MAX_TENSOR_BYTES` (torch
    computes strides from them even where a dimension is 0).

    Raises:
        CheckpointEngineError: ``{what}: shape ...``, naming what is allowed.
    """
    numel, span = 1, 1
    for size in shape:
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= 2**63 - 1:
            raise CheckpointEngineError(
                f"{what}: shape {_shown(shape)}: a dimension of {_shown(size)}; each is an "
                "integer in [0, 2**63)"
            )
        numel *= size
        span *= max(size, 1)
        if span * dtype.itemsize > MAX_TENSOR_BYTES:  # at once: no product of a million dims
            raise CheckpointEngineError(
                f"{what}: shape {_shown(shape)} of {dtype_name(dtype)} spans more than 2**63 - 1 "
                "bytes (its non-empty dimensions' product times the element size): no tensor "
                "is that large"
            )
    return numel


def _shown(value: object, most: int = 80) -> str:
    """``repr(value)`` cut to ``most`` characters: a message never carries a whole shape."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else "<?>"
    return text if len(text) <= most else text[: most - 3] + "..."
