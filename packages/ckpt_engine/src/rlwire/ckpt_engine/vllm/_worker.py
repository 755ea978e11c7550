"""The inference side: an rlwire receiver inside each vLLM worker process.

vLLM builds one :class:`RlwireWeightTransferEngine` per worker (tensor- and
pipeline-parallel ranks, data-parallel replicas) when it starts with
``weight_transfer_config={"backend": "rlwire_<name>"}``. Each joins the trainer's rlwire
group as one receiver; an update is received whole beside the model (nothing is written
into it before the whole update arrived, matched and, with ``checksum``, verified), then
written through vLLM's own checkpoint-format path (layerwise reload around
``model.load_weights``, which takes each rank's shard and fuses what vLLM fuses). A
delta update rewrites only the layers whose tensors changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from .._admission import admit, required_token
from .._apply import StagedUpdate, stage_update
from .._base import DEFAULT_TIMEOUT_S, CheckpointEngine
from .._errors import CheckpointEngineError
from .._registry import registry
from ._layers import layer_of, quiet_layerwise, refresh_tied
from ._names import ANY, backend_of

__all__ = [
    "RlwireInitInfo",
    "RlwireUpdateInfo",
    "RlwireWeightTransferEngine",
    "WorkerExtension",
    "run_coroutine",
]

logger = init_logger(__name__)

T = TypeVar("T")


@dataclasses.dataclass
class RlwireInitInfo(WeightTransferInitInfo):
    """What a worker needs to join (built by the trainer side, sent through vLLM's
    ``init_weight_transfer_engine``): the master's metadata and the group's size, and the
    server's weight-transfer token where it demands one
    (:data:`rlwire.ckpt_engine.WEIGHT_TRANSFER_TOKEN_ENV`)."""

    backend: str
    master_metadata: dict[str, Any]
    world_size: int
    rank_offset: int = 1
    timeout: float = DEFAULT_TIMEOUT_S
    checksum: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    token: str | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class RlwireUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version the trainer sends (checked against what arrives)."""

    version: int | None = None
    """None: whichever version arrives (a receiver that learns it on receipt)."""

    def __post_init__(self) -> None:
        if self.version is not None and (
            isinstance(self.version, bool) or not isinstance(self.version, int)
        ):
            raise ValueError(f"version: {self.version!r} is not an int or None")


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end from synchronous code, in a thread of its own when the
    caller is itself inside an event loop (vLLM calls its engines synchronously)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    value: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            value.append(asyncio.run(coro))
        except BaseException as err:  # re-raised in the caller
            error.append(err)

    thread = threading.Thread(target=target, name="rlwire-vllm-receive", daemon=True)
    thread.start()
    thread.join()  # the engine bounds every wait inside by its own timeout
    if error:
        raise error[0]
    return value[0]


class RlwireWeightTransferEngine(WeightTransferEngine[RlwireInitInfo, RlwireUpdateInfo]):
    """vLLM's ``WeightTransferEngine`` over one rlwire backend: ``config.backend`` is
    ``rlwire_<name>``, or ``rlwire`` for the one the trainer side names at
    ``init_weight_transfer_engine``.

    The engine keeps the last version it wrote as checkpoint-format tensors (its *mirror*,
    one model-sized copy where the backend delivers: host memory for ``gloo``, ``shm`` and
    ``filesystem``, the device for ``nccl`` and ``cuda_ipc``) when the trainer sends
    deltas: a delta applies onto that exact version, and vLLM's loader is then given whole
    tensors. Received tensors are kept for the next update either way (``spare``).
    """

    init_info_cls = RlwireInitInfo
    update_info_cls = RlwireUpdateInfo
    supports_draft_weight_update = False  # one group per model: a draft model needs its own

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.fixed = None if config.backend == ANY else backend_of(config.backend)
        self.backend = self.fixed or "?"
        self.engine: CheckpointEngine | None = None
        self.deltas = False
        self.mirror: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The version vLLM's model holds (None: the weights it started with)."""
        self.spare: dict[str, torch.Tensor] = {}
        """Host tensors a whole update is received into, kept for the next one."""
        self.layout: dict[str, tuple[torch.Size, torch.dtype]] = {}
        """Names, shapes and dtypes of the last update written (a dense one must match)."""
        self._staged: StagedUpdate | dict[str, torch.Tensor] | None = None
        self._staged_version: int | None = None
        self._layers: tuple[Any, dict[str, str | None]] | None = None
        self.written: tuple[int, int] = (0, 0)
        """Checkpoint tensors the last update wrote through vLLM's loader, of those held."""

    @property
    def staged_version(self) -> int | None:
        """The version received and not yet written in (``finish_weight_update``)."""
        return self._staged_version

    @property
    def progressed_at(self) -> float | None:
        """When the transfer of the group joined last moved
        (:attr:`rlwire.ckpt_engine.CheckpointEngine.progressed_at`); None before joining."""
        return None if self.engine is None else self.engine.progressed_at

    # --- lifecycle -------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: RlwireInitInfo) -> None:
        """Join the caller's group as a receiver (leaving the one joined before, and dropping
        an update it received that was not written in). A server started with a weight-transfer
        token takes the init only with that token and no backend options from the caller
        (:func:`rlwire.ckpt_engine._admission.admit`); a refused one leaves the group this
        engine is in untouched."""
        admit(
            required=required_token(),
            token=init_info.token,
            options=init_info.options,
            name=str(self.config.backend),
        )
        backend = backend_of(init_info.backend)
        if self.fixed is not None and backend != self.fixed:
            raise ValueError(
                f"the trainer sends with {init_info.backend!r} but this vLLM engine was "
                f"started with weight_transfer_config backend {self.config.backend!r} (or "
                f"{ANY!r}: any rlwire backend)"
            )
        self.shutdown()
        # An update the old group delivered and nobody wrote in (its run died between
        # receive and finish_weight_update) is dropped: the new group sends whole updates
        # from what vLLM's model holds (``version``), which stays as it is.
        self._staged = self._staged_version = None
        self.backend = backend
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        rank = init_info.rank_offset + worker
        engine = registry.new(
            self.backend,
            timeout=init_info.timeout,
            checksum=init_info.checksum,
            **init_info.options,
        )
        engine.prepare()
        engine.init_process_group(
            rank=rank, world_size=init_info.world_size, master_metadata=init_info.master_metadata
        )
        engine.last_version = self.version  # what vLLM holds (filesystem: wait for a newer one)
        self.engine = engine
        self.deltas = init_info.master_metadata.get("delta", "off") != "off"
        logger.info(
            "rlwire_%s: joined as receiver %d of %d", self.backend, rank, init_info.world_size - 1
        )

    def start_weight_update(self) -> None:
        """Nothing to prepare: an update is received whole by ``update_weights`` (or by
        :meth:`receive` ahead of time) and written in by :meth:`finish_weight_update`."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronises the accelerator, which raises on a CPU host; the
        # rlwire backends hand over tensors that are complete when they are yielded.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RlwireUpdateInfo) -> None:
        """Receive one whole update beside the model; nothing is written into it here."""
        run_coroutine(self.receive(update_info.version))

    async def receive(self, version: int | None = None) -> int:
        """Receive one whole update beside the model (it may keep generating meanwhile, in
        another thread); :meth:`finish_weight_update` writes it in. ``version``: the one the
        trainer announced (checked), or None. Returns the version received."""
        if self.engine is None:
            raise CheckpointEngineError(
                f"rlwire_{self.backend}: update_weights before init_weight_transfer_engine"
            )
        if self._staged is not None:
            raise CheckpointEngineError(
                f"rlwire_{self.backend}: version {self._staged_version} is received and not yet "
                "written in (finish_weight_update); rlwire sends a whole update per call"
            )
        staged, received = await self._receive()
        if version is not None and received != version:
            raise CheckpointEngineError(
                f"rlwire_{self.backend}: received version {received} but the trainer announced "
                f"{version}; vLLM keeps version {self.version}"
            )
        self._staged, self._staged_version = staged, received
        return received

    async def _receive(self) -> tuple[StagedUpdate | dict[str, torch.Tensor], int]:
        engine = self.engine
        assert engine is not None
        if self.deltas and self.mirror:
            # deltas onto the mirror, whole tensors into the spare copies (swapped in at the
            # commit: the mirror's old storage becomes the next update's spare)
            staged = await stage_update(
                self.mirror, engine, staging=self.spare, version=self.version, swap=True
            )
            return staged, staged.version
        received: dict[str, torch.Tensor] = {}
        async for name, tensor in engine.receive_weights(copy=False):
            kept = self.spare.get(name)  # reused across updates: no page faults after the first
            if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                kept = self.spare[name] = torch.empty_like(tensor)
            received[name] = kept.copy_(tensor)
        if self.layout:  # a dense update must carry the same tensors as the last one
            _check_layout(self.backend, self.layout, received)
        assert engine.last_version is not None
        return received, engine.last_version

    def finish_weight_update(self) -> None:
        """Write the staged update into vLLM's model through its checkpoint-format loader."""
        staged, version = self._staged, self._staged_version
        self._staged = self._staged_version = None
        if staged is None or version is None:
            raise CheckpointEngineError(
                f"rlwire_{self.backend}: finish_weight_update without a received update; vLLM "
                f"keeps version {self.version}"
            )
        only: set[str] | None = None  # every tensor
        if isinstance(staged, StagedUpdate):
            only = staged.changed  # a delta onto what vLLM holds: the rest is written in
            staged.commit()  # the deltas onto the mirror: it now holds the new version
            weights = self.mirror
        else:
            weights = staged
        try:
            self._load(weights, only)
        except Exception as err:
            raise CheckpointEngineError(
                f"rlwire_{self.backend}: vLLM's loader failed on version {version} ({err}); "
                + self._restore()
            ) from err
        self.layout = {name: (t.shape, t.dtype) for name, t in weights.items()}
        if self.deltas and weights is not self.mirror:  # a dense update becomes the mirror
            self.mirror, self.spare = weights, {}
        self.version = version

    def _load(self, weights: dict[str, torch.Tensor], only: set[str] | None = None) -> None:
        """Write ``weights`` in through vLLM's layerwise reload; with ``only`` (the names a
        delta changed) just the layers those feed, each whole (every checkpoint tensor of
        a fused ``qkv_proj`` or ``gate_up_proj``, from the mirror): the other layers keep
        what they hold, which is what the mirror holds for them."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        names = list(weights) if only is None else self._layer_names(weights, only)
        initialize_layerwise_reload(self.model)
        with torch.no_grad(), quiet_layerwise(partial=len(names) < len(weights)):
            self.model.load_weights((name, weights[name]) for name in names)
            finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied(self.model)
        self.written = (len(names), len(weights))

    def _layer_names(self, weights: dict[str, torch.Tensor], changed: set[str]) -> list[str]:
        """The checkpoint names that feed a layer one of ``changed`` feeds (all of them
        when a name's layer is not found: a layout this mapping does not know)."""
        names = frozenset(weights)  # (not the dict's keys view: it would keep the dict)
        if self._layers is None or self._layers[0] != names:
            self._layers = (names, {name: layer_of(self.model, name) for name in weights})
        layers = self._layers[1]
        touched = {layers[name] for name in changed}
        if None in touched:
            return list(weights)
        return [name for name in weights if layers[name] in touched]

    def _restore(self) -> str:
        """After a failed load: what the model holds now. Before the first update its own
        files are loaded again; after one, the previous version is gone (the mirror took
        the new one in place), so nothing is kept and the next update is sent whole."""
        self.mirror, self.spare = {}, {}
        if self.version is None:
            from vllm.model_executor.model_loader.reload import reload_weights

            reload_weights(self.vllm_config, self.model, None, None, True)
            refresh_tied(self.model)
            return "the weights it started with were reloaded from the model's files"
        self.version = None  # unknown now: no delta may apply onto it
        return "the model may hold part of it: the next update is sent whole"

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.finalize()
            self.engine = None


def _check_layout(
    backend: str, held: dict[str, tuple[torch.Size, torch.dtype]], new: dict[str, torch.Tensor]
) -> None:
    differ = sorted(
        name
        for name in held.keys() | new.keys()
        if name not in held or name not in new or held[name] != (new[name].shape, new[name].dtype)
    )
    if differ:
        raise CheckpointEngineError(
            f"rlwire_{backend}: the update's tensors differ from the last one's (names, shapes "
            f"or dtypes): {differ[:8]}{' ...' if len(differ) > 8 else ''}"
        )


class WorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls
    rlwire.ckpt_engine.vllm.WorkerExtension``): what its rlwire engine holds, for a
    trainer that drives a ``vllm serve`` server over HTTP (``/collective_rpc``, with
    ``VLLM_SERVER_DEV_MODE=1``) and must learn the version an update carried."""

    def rlwire_weight_versions(self) -> dict[str, Any]:
        """``backend`` (None before the trainer joined), ``held`` (the version written
        into the model; None: the weights it started with) and ``staged`` (received, not
        yet written in)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, RlwireWeightTransferEngine):
            return {"backend": None, "held": None, "staged": None, "rlwire": False}
        return {
            "backend": engine.backend if engine.engine is not None else None,
            "held": engine.version,
            "staged": engine.staged_version,
            "rlwire": True,
        }

    def rlwire_end_update(self) -> bool:
        """End an update that a trainer which went away left open: vLLM's session
        (``start_weight_update`` without ``finish_weight_update``, which refuses the next
        start) and what the rlwire engine received and did not write in. The weights vLLM
        holds stay. Whether a session was open (a trainer calls it before it joins)."""
        engine = getattr(self, "weight_transfer_engine", None)
        was_open = bool(getattr(self, "_weight_update_active", False))
        if was_open:
            self._weight_update_active = False
            reset = getattr(engine, "reset_weight_update_target", None)
            if reset is not None:
                reset()
        if isinstance(engine, RlwireWeightTransferEngine):
            engine._staged = engine._staged_version = None
        return was_open
