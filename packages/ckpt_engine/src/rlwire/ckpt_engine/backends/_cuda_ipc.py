"""``cuda_ipc``: same node, different processes: receivers map the master's device slots once."""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from .._bucket_copy import ReceiveStats, receive_into
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
            torch.storage.TypedStorage, dtype_from_name(h["dtype"], "cuda_ipc: a slot handle"),
            device_index, _unb64(h["handle"]), int(h["storage_bytes"]), int(h["storage_offset"]),
            False, _unb64(h["ref_handle"]), int(h["ref_offset"]), _unb64(h["event_handle"]),
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
    The handles cross once, at join, and are opened once per engine: buckets of
    every later update (and version) arrive in the same two mapped slots, and a
    bucket's tensors are views of its slot.

    :meth:`receive_into` is the fast receive: each bucket written straight into the
    caller's tensors in one batched copy and one stream synchronisation, where
    ``receive_weights`` hands out one tensor at a time.

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

    async def receive_into(
        self, targets: Mapping[str, torch.Tensor], *, base_version: int | None = None
    ) -> ReceiveStats:
        """Receive one update straight into ``targets`` (name to tensor), bucket by bucket.

        Per bucket: views of the mapped slot at each chunk's offset, copied into each
        target's bytes at the chunk's offset with one ``torch._foreach_copy_`` per word
        width (a tensor split over buckets lands in place, no reassembly), delta entries
        (``base_version`` given) applied onto their targets, then one synchronisation of
        the current stream before the bucket is acknowledged. Nothing per tensor waits on
        the host; the cost per bucket is one synchronisation and one store round trip, so
        larger buckets amortise it (at the price of two slots of ``bucket_size`` on the
        device). ``receive_weights(copy=False)`` with a ``copy_`` per item moves the same
        bytes, one launch per tensor.

        Targets: every name of the update, contiguous, of its shape and dtype, on the
        slots' GPU for the batched route (another device works, one copy each). A name
        that does not match is skipped and the update still consumed (the group stays in
        step); the error comes at the end, so targets may then be partly written.

        Returns:
            What was written, with the host time spent applying
            (:class:`~rlwire.ckpt_engine._bucket_copy.ReceiveStats`).

        Raises:
            CheckpointEngineError: the update does not match ``targets`` (unknown, missing
                or mismatched names), a corrupted bucket (``checksum``), a delta from
                another version than ``base_version``.
            CheckpointEngineTimeout: a bucket did not come within ``timeout``.
        """
        return await receive_into(self, targets, base_version=base_version)

    async def _before_publish(self, slot: int, meta: BucketMeta) -> None:
        torch.cuda.current_stream(self.slots[slot].device).synchronize()

    async def _before_ack(self, meta: BucketMeta) -> None:
        torch.cuda.current_stream(self.slots[meta.index % 2].device).synchronize()
