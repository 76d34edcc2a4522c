"""The public path ``notebook_accel.parallelism_config`` (Accelerate's ``accelerate.parallelism_config``).

``ParallelismConfig`` and its handler configs live in ``notebook_accel.utils.parallelism`` (low in the
layering, so the state and the accelerator can both read them); this module re-exports them.
"""

from __future__ import annotations

from .utils.enums import DistributedType
from .utils.imports import is_torch_version
from .utils.parallelism import (
    DeepSpeedSequenceParallelConfig,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)

__all__ = [
    "DeepSpeedSequenceParallelConfig",
    "DistributedType",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "is_torch_version",
]
