"""The gradient scaler that fp16 mixed precision needs, for the device this process trains on."""

from __future__ import annotations

from typing import Any

import torch

from .enums import DistributedType
from .imports import (
    is_cuda_available,
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_npu_available,
    is_sdaa_available,
    is_xpu_available,
)

__all__ = ["get_grad_scaler"]

# In the order a process picks its device: the first available accelerator, else the CPU.
_DEVICE_CHECKS = (
    ("cuda", is_cuda_available),
    ("xpu", is_xpu_available),
    ("npu", is_npu_available),
    ("mlu", is_mlu_available),
    ("musa", is_musa_available),
    ("sdaa", is_sdaa_available),
    ("hpu", is_hpu_available),
    ("mps", is_mps_available),
)


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> Any:
    """Return a ``torch.amp.GradScaler`` for this process's device (``kwargs`` go to its constructor).

    ``distributed_type=DistributedType.XLA`` returns torch_xla's scaler (install torch_xla to use it);
    FSDP keeps sharded gradients and uses torch's ``ShardedGradScaler``.
    """
    if distributed_type is not None and distributed_type not in DistributedType:
        raise ValueError(
            f"distributed_type={distributed_type!r} is not valid; choose one of {DistributedType.list()}"
        )
    if distributed_type == DistributedType.XLA:
        try:
            import torch_xla.amp as xamp
        except ImportError as error:
            raise ImportError(
                "get_grad_scaler(DistributedType.XLA) needs torch_xla: pip install torch_xla"
            ) from error
        return xamp.GradScaler(**kwargs)
    device = next((name for name, available in _DEVICE_CHECKS if available()), "cpu")
    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, **kwargs)
    return torch.amp.GradScaler(device, **kwargs)
