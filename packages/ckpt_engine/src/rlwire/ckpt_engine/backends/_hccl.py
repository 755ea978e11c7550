"""``hccl``: Ascend NPUs. Registered by name; needs torch_npu, which this package does not ship."""

from __future__ import annotations


def _require_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "the hccl checkpoint engine needs torch_npu (Ascend's PyTorch adapter) matching "
            "your torch version; install it from Ascend's distribution"
        ) from err


_require_torch_npu()

# With torch_npu present an NPU engine would follow the nccl design over HCCL;
# it is not implemented yet, so importing past the check is an explicit error.
raise ImportError("the hccl checkpoint engine is not implemented yet in rlwire-ckpt-engine")
