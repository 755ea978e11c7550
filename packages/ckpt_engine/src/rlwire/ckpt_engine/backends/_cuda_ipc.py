"""``cuda_ipc``: same node, different processes: receivers map the master's device slots once."""

from __future__ import annotations

import base64
import pickle

import torch

from .._control import StoreControlledEngine, cuda_device
from .._errors import CheckpointEngineError
from .._wire import BucketMeta

__all__ = ["CudaIpcEngine"]


def _export(tensor: torch.Tensor) -> str:
    from torch.multiprocessing.reductions import reduce_tensor

    return base64.b64encode(pickle.dumps(reduce_tensor(tensor))).decode()


def _import(handle: str) -> torch.Tensor:
    rebuild, args = pickle.loads(base64.b64decode(handle))
    return rebuild(*args)


class CudaIpcEngine(StoreControlledEngine):
    """Two CUDA bucket slots owned by the master and mapped once by every receiver.

    The colocated hybrid-engine case: trainer and rollout processes on one
    GPU (or one node). The master packs on its current stream and
    synchronises it before announcing a bucket (the bytes are on the device,
    not merely launched); a receiver synchronises its stream before
    acknowledging (its reads are done, so the master may overwrite the slot).
    With ``copy=False`` receivers get device views into the mapped slot.

    Args:
        device: the CUDA device for the slots (default: the current device).
    """

    name = "cuda_ipc"

    def __init__(self, *, device: torch.device | str | None = None, **kwargs) -> None:
        self.device = cuda_device(device, "cuda_ipc")
        super().__init__(**kwargs)

    def _buffer_device(self) -> torch.device:
        return self.device

    def _create_slots(self) -> dict:
        self.slots = [
            torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]
        return {"handles": [_export(s) for s in self.slots]}

    def _attach_slots(self, master_metadata: dict) -> None:
        try:
            self.slots = [_import(h) for h in master_metadata["handles"]]
        except (KeyError, RuntimeError) as err:
            raise CheckpointEngineError(f"cuda_ipc: cannot map the master's slots: {err}") from err

    async def _before_publish(self, slot: int, meta: BucketMeta) -> None:
        torch.cuda.current_stream(self.slots[slot].device).synchronize()

    async def _before_ack(self, meta: BucketMeta) -> None:
        torch.cuda.current_stream(self.slots[meta.index % 2].device).synchronize()
