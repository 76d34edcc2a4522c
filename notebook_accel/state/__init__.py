"""The process world and the state singletons, at the path Accelerate users import (``accelerate.state``).

- :mod:`.world`: read the launch environment once into a frozen ``ProcessWorld``;
- :mod:`.split`: one process's share of a list, tensor or dict (``split_between_processes``);
- :mod:`.process`: ``PartialState`` and ``AcceleratorState``, the shared ("Borg") singletons over it;
- :mod:`.gradient`: ``GradientState``, the gradient-accumulation and dataloader bookkeeping.

This package imports only :mod:`notebook_accel.utils` (see docs/architecture.md).
"""

from __future__ import annotations

from ..utils.device_info import check_cuda_fp8_capability, check_cuda_p2p_ib_support, set_numa_affinity
from ..utils.enums import DistributedType, DynamoBackend, SageMakerDistributedType
from ..utils.environment import (
    get_cpu_distributed_information,
    get_int_from_env,
    parse_choice_from_env,
    parse_flag_from_env,
)
from ..utils.imports import (
    deepspeed_required,
    is_fp8_available,
    is_habana_gaudi1,
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xccl_available,
    is_xpu_available,
)
from ..utils.package_checks import is_datasets_available, is_deepspeed_available
from ..utils.plugins import GradientAccumulationPlugin
from .gradient import GradientState
from .process import AcceleratorState, PartialState

# Besides the singletons, names code written for Accelerate imports from accelerate.state.
from .shared import ThreadLocalSharedDict, do_nothing, is_initialized

__all__ = [
    "AcceleratorState",
    "DistributedType",
    "GradientState",
    "PartialState",
    "ThreadLocalSharedDict",
    "do_nothing",
    "is_initialized",
    "parse_flag_from_env",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "DynamoBackend",
    "GradientAccumulationPlugin",
    "SageMakerDistributedType",
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "deepspeed_required",
    "get_cpu_distributed_information",
    "get_int_from_env",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_sdaa_available",
    "is_torch_xla_available",
    "is_xccl_available",
    "is_xpu_available",
    "parse_choice_from_env",
    "set_numa_affinity",
]
