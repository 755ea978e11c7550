"""Checkpoint engines: move trainer weights to rollout workers.

One API over several transports (``gloo``, ``shm``, ``filesystem``, ``naive``,
``nccl``, ``cuda_ipc``, ``hccl``), bucketed with 256-byte aligned tensors, versioned,
optionally checksummed, and with every wait bounded by ``timeout``. Importing
this package imports no optional dependency: backends load on first use.
"""

from __future__ import annotations

from ._admission import TOKEN_ENV as WEIGHT_TRANSFER_TOKEN_ENV
from ._apply import StagedUpdate, apply_to_module, stage_update
from ._base import DEFAULT_TIMEOUT_S, CheckpointEngine, TransferStats
from ._delta import DELTA_MODES, Delta, diff
from ._errors import (
    CheckpointEngineAborted,
    CheckpointEngineAuthError,
    CheckpointEngineError,
    CheckpointEngineTimeout,
)
from ._fp8 import FP8_BLOCK, dequantize_fp8_blocks, fp8_weights, quantize_fp8_blocks
from ._positions import COMPRESS_MODES
from ._registry import (
    BackendCapabilities,
    CheckpointEngineRegistry,
    backend_for_device,
    registry,
)
from ._segments import mapped_segment_owners, process_running, remove_segments
from ._sizes import DEFAULT_BUCKET_SIZE, parse_bucket_size
from ._store import bound_store

__all__ = [
    "COMPRESS_MODES",
    "DEFAULT_BUCKET_SIZE",
    "DELTA_MODES",
    "FP8_BLOCK",
    "BackendCapabilities",
    "DEFAULT_TIMEOUT_S",
    "StagedUpdate",
    "CheckpointEngine",
    "CheckpointEngineAborted",
    "CheckpointEngineAuthError",
    "CheckpointEngineError",
    "CheckpointEngineRegistry",
    "CheckpointEngineTimeout",
    "Delta",
    "TransferStats",
    "WEIGHT_TRANSFER_TOKEN_ENV",
    "apply_to_module",
    "backend_for_device",
    "bound_store",
    "dequantize_fp8_blocks",
    "diff",
    "fp8_weights",
    "mapped_segment_owners",
    "parse_bucket_size",
    "registry",
    "process_running",
    "quantize_fp8_blocks",
    "remove_segments",
    "stage_update",
]
