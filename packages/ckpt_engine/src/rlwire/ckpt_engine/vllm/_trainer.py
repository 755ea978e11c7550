"""The trainer side: vLLM's ``TrainerWeightTransferEngine`` over an rlwire sender.

Any trainer drives it through vLLM's own API::

    info = RlwireTrainerInitInfo(backend="rlwire_shm", rank=rank, receivers=tp * dp)
    sender = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    sender.send_weights()          # every trainer rank, after each optimizer step

``client`` is any of vLLM's weight-sync clients (``HTTPVLLMWeightSyncClient`` for a
``vllm serve`` server, ``RayVLLMWeightSyncClient``) or :class:`LLMClient` for an
in-process ``vllm.LLM``. Rank 0 sends; other ranks iterate the source (its collective
gathers) and send nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from .._admission import required_token
from .._base import DEFAULT_TIMEOUT_S, CheckpointEngine, TransferStats
from .._delta import check_delta_mode
from .._errors import CheckpointEngineError, CheckpointEngineTimeout
from .._registry import registry
from ._names import backend_of
from ._worker import run_coroutine

__all__ = ["LLMClient", "RlwireTrainerEngine", "RlwireTrainerInitInfo"]


@dataclasses.dataclass
class RlwireTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of an rlwire weight transfer into vLLM.

    ``backend``: ``rlwire_<name>``, as the vLLM side was started with. ``receivers``: how
    many vLLM worker processes take updates (tensor x pipeline x data parallel size of
    every engine the client drives); each joins as one receiver. The rest are the rlwire
    engine's options (:class:`rlwire.ckpt_engine.CheckpointEngine`): ``bucket_size``,
    ``timeout``, ``checksum``, ``delta``; ``host`` where receivers reach a store-controlled
    master (``gloo``, ``shm``: loopback unless vLLM runs on other hosts), ``options`` any
    of the backend's own (``root`` for ``filesystem``; a server that requires a token takes
    none). ``token``: the server's weight-transfer token, for a server started with
    ``RLWIRE_WEIGHT_TRANSFER_TOKEN`` (None: that variable of this process, if set).
    """

    backend: str = "rlwire_shm"  # a field here: one class, any rlwire backend
    receivers: int = 1
    bucket_size: int | str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    checksum: bool = False
    delta: str = "off"
    host: str = "127.0.0.1"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        backend_of(self.backend)
        if (
            isinstance(self.receivers, bool)
            or not isinstance(self.receivers, int)
            or (self.receivers < 1)
        ):
            raise ValueError(f"receivers: {self.receivers!r} is not allowed; use an int >= 1")
        check_delta_mode(self.delta)


class RlwireTrainerEngine(TrainerWeightTransferEngine[RlwireTrainerInitInfo]):
    """Sends every ``send_weights`` as one rlwire update (version 1, 2, ... unless given),
    driving vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``
    around it; vLLM's weight version becomes the update's version."""

    init_info_cls: ClassVar[type] = RlwireTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.engine: CheckpointEngine | None = None
        self.info: RlwireTrainerInitInfo | None = None
        self.version = 0
        self.last_stats: TransferStats | None = None
        self._broken = False  # the last update failed: rejoin before the next

    @classmethod
    def trainer_init(
        cls, init_info: RlwireTrainerInitInfo, *, client: Any, source: Any = None
    ) -> Self:
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self._join()
        return self

    def _join(self) -> None:
        """Build the rlwire engine and the group with vLLM's workers (again after a failed
        update: a group whose transfer broke off is not reused)."""
        info = self.info
        assert info is not None
        if self.engine is not None:
            self.engine.finalize()
            self.engine = None
        backend = backend_of(info.backend)
        options: dict[str, Any] = dict(info.options)
        if registry.capabilities(backend).uses_store:
            options["host"] = info.host
        engine = registry.new(
            backend,
            is_master=self.is_sender,
            bucket_size=info.bucket_size,
            timeout=info.timeout,
            checksum=info.checksum,
            delta=info.delta if self.is_sender else "off",
            **options,
        )
        world = 1 + info.receivers
        if not self.is_sender:
            engine.init_process_group(rank=-1, world_size=world, master_metadata={})
            self.engine = engine
            return
        metadata = engine.prepare()
        worker_info = {
            "backend": info.backend,
            "master_metadata": metadata,
            "world_size": world,
            "rank_offset": 1,
            "timeout": info.timeout,
            "checksum": info.checksum,
            "options": dict(info.options),
        }
        token = info.token or required_token()
        if token:
            worker_info["token"] = token
        # vLLM's workers join while the master does: the client's call returns only then.
        self._beside(
            "init_weight_transfer_engine",
            lambda: self.client.init_weight_transfer_engine(worker_info),
            lambda: engine.init_process_group(rank=0, world_size=world, master_metadata=metadata),
            engine,
        )
        self.engine = engine
        self._broken = False

    def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        *,
        version: int | None = None,
    ) -> TransferStats:
        """Send one update: ``weights`` (default: the source given at ``trainer_init``) as
        ``version`` (default: one more than the last). Returns what moved; on rank 0 once
        vLLM serves the new weights. A failed update raises and vLLM keeps serving the
        version it held."""
        engine = self.engine
        if engine is None:
            raise CheckpointEngineError("send_weights before trainer_init")
        if weights is None:
            if self.source is None:
                raise CheckpointEngineError(
                    "send_weights: no weights given and no source at trainer_init"
                )
            weights = self.source
        version = self.version + 1 if version is None else version
        if self._broken:
            self._join()
            engine = self.engine
            assert engine is not None
        if not self.is_sender:
            run_coroutine(engine.send_weights(weights, version=version))
            self.version = version
            return TransferStats(0, 0, 0, 0.0)
        self.client.start_weight_update()
        box: dict[str, TransferStats] = {}

        def send() -> None:
            box["stats"] = run_coroutine(engine.send_weights(iter(weights), version=version))

        self._broken = True  # until the update went through
        self._beside(
            f"update_weights (version {version})",
            lambda: self.client.update_weights({"version": version}),
            send,
            engine,
        )
        self._broken = False
        self.client.finish_weight_update(weight_version=str(version))
        self.version = version
        self.last_stats = box["stats"]
        return box["stats"]

    def _beside(
        self,
        what: str,
        remote: Callable[[], None],
        local: Callable[[], None],
        engine: CheckpointEngine,
    ) -> None:
        """Run the client's ``remote`` call in a thread while ``local`` runs here, both
        bounded by the engine's timeout; a failure names both sides' reasons and the version
        vLLM keeps."""
        failure: list[BaseException] = []

        def call() -> None:
            try:
                remote()
            except BaseException as err:  # re-raised below
                failure.append(err)

        thread = threading.Thread(target=call, name=f"rlwire-vllm-{what}", daemon=True)
        thread.start()
        wait = engine.timeout + 30
        keeps = f"vLLM keeps version {self.version}" if self.version else "vLLM keeps its weights"
        try:
            local()
        except BaseException as err:
            thread.join(wait)  # the receivers give up within the engine's timeout
            remote_reason = f"; vLLM's {what}: {failure[0]}" if failure else ""
            raise CheckpointEngineError(
                f"{what}: the trainer side failed: {err}{remote_reason}; {keeps}"
            ) from err
        thread.join(wait)
        if thread.is_alive():
            raise CheckpointEngineTimeout(f"vLLM's {what} did not return within {wait:.0f} s")
        if failure:
            raise CheckpointEngineError(f"vLLM's {what} failed: {failure[0]}; {keeps}") from (
                failure[0]
            )

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.finalize()
            self.engine = None


class LLMClient:
    """vLLM's weight-sync client protocol over an in-process ``vllm.LLM`` (whose own
    methods take request objects rather than the protocol's plain dicts)."""

    def __init__(self, llm: Any) -> None:  # a vllm.LLM
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
