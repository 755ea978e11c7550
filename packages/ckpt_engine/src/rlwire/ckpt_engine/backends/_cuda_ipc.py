"""``cuda_ipc``: same node, different processes: receivers map the master's device slots once."""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import os
from typing import Any

import torch

from .._control import StoreControlledEngine, cuda_device
from .._errors import CheckpointEngineError
from .._store import peer_errors
from .._wire import BucketMeta, dtype_from_name, dtype_name

__all__ = ["CudaIpcEngine"]


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)


def _export(tensor: torch.Tensor) -> str:
    """A slot's CUDA IPC handle as plain JSON (what torch's ``reduce_tensor`` would pickle:
    its rebuild arguments, of which only numbers, byte strings and a dtype name vary)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]  # torch: untyped
    if rebuild is not rebuild_cuda_tensor or args[0] is not torch.Tensor:
        raise CheckpointEngineError(f"cuda_ipc: cannot export a {args[0].__name__} slot")
    (_, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes,
     storage_offset, _, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    if storage_cls is not torch.storage.TypedStorage:
        raise CheckpointEngineError(f"cuda_ipc: cannot export {storage_cls.__name__} storage")
    return json.dumps({
        "size": list(size), "stride": list(stride), "offset": offset,
        "dtype": dtype_name(dtype), "device": device, "handle": _b64(handle),
        "storage_bytes": storage_bytes, "storage_offset": storage_offset,
        "ref_handle": _b64(ref_handle), "ref_offset": ref_offset,
        "event_handle": _b64(event_handle), "event_sync": bool(event_sync),
    })  # fmt: skip


def _import(handle: str, device_index: int) -> torch.Tensor:
    """Map an exported slot; ``device_index`` is this process's index of the master's GPU
    (the master's own index means another GPU where CUDA_VISIBLE_DEVICES differ). Nothing
    is unpickled: the handle is JSON of numbers and base64 byte strings."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        h = json.loads(handle)
        args = (
            torch.Tensor, torch.Size([int(n) for n in h["size"]]),
            tuple(int(n) for n in h["stride"]), int(h["offset"]),
            torch.storage.TypedStorage, dtype_from_name(h["dtype"]), device_index,
            _unb64(h["handle"]), int(h["storage_bytes"]), int(h["storage_offset"]), False,
            _unb64(h["ref_handle"]), int(h["ref_offset"]), _unb64(h["event_handle"]),
            bool(h["event_sync"]),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, binascii.Error) as err:
        raise CheckpointEngineError(f"cuda_ipc: a slot handle is malformed ({err})") from None
    mapped: torch.Tensor = rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]  # torch: untyped
    return mapped


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if _uuid(index) == uuid:
            return index
    raise CheckpointEngineError(
        f"cuda_ipc: the master's GPU {uuid} is not visible in this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
        "cuda_ipc needs the master and its receivers on one node and GPU; use nccl otherwise"
    )


class CudaIpcEngine(StoreControlledEngine):
    """Two CUDA bucket slots owned by the master and mapped once by every receiver.

    The colocated hybrid-engine case: trainer and rollout processes on one
    GPU (or one node). The master packs on its current stream and
    synchronises it before announcing a bucket (the bytes are on the device,
    not merely launched); a receiver synchronises its current stream before
    acknowledging (its reads are done, so the master may overwrite the slot).
    With ``copy=False`` receivers get device views into the mapped slot: read
    them on the current stream (a side stream's reads are not waited for).

    Each receiver maps its own export of the slots (torch counts the mappings
    of one export; sharing it between receivers would free the slots early or
    never), found by the GPU's UUID, so differing ``CUDA_VISIBLE_DEVICES`` work.

    Args:
        device: the CUDA device for the slots (default: the current device).
    """

    name = "cuda_ipc"
    device_type = "cuda"

    def __init__(self, *, device: torch.device | str | None = None, **kwargs: Any) -> None:
        self.device = cuda_device(device, "cuda_ipc")
        super().__init__(**kwargs)

    def _buffer_device(self) -> torch.device:
        return self.device

    def _create_slots(self) -> dict[str, Any]:
        self.slots = [
            torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device) for _ in range(2)
        ]
        return {"device_uuid": _uuid(self.device.index)}

    def _publish_slots(self, receivers: list[int]) -> None:
        for rank in receivers:  # one export per receiver
            handles = json.dumps([_export(s) for s in self.slots])
            self._joined_store.set(f"cuda_ipc/slots/{rank}", handles)

    def _attach_slots(self, master_metadata: dict[str, Any]) -> None:
        if "device_uuid" not in master_metadata:
            raise CheckpointEngineError(
                "cuda_ipc: master_metadata has no 'device_uuid' (pass the master's prepare())"
            )
        index = _local_index(master_metadata["device_uuid"])
        key = f"cuda_ipc/slots/{self.rank}"
        with peer_errors("cuda_ipc: waiting for the master's slots", self.timeout):
            [raw] = self._joined_store.wait_get([key], datetime.timedelta(seconds=self.timeout))
            handles = json.loads(raw)
        try:
            self.slots = [_import(h, index) for h in handles]
        except RuntimeError as err:
            raise CheckpointEngineError(f"cuda_ipc: cannot map the master's slots: {err}") from err
        self.device = torch.device("cuda", index)

    async def _before_publish(self, slot: int, meta: BucketMeta) -> None:
        torch.cuda.current_stream(self.slots[slot].device).synchronize()

    async def _before_ack(self, meta: BucketMeta) -> None:
        torch.cuda.current_stream(self.slots[meta.index % 2].device).synchronize()
