"""``accelerate.utils`` modeling names, re-exported from the topic modules that define them.

sizes: byte accounting; device_memory: budgets; device_map: strategies, planning (planner) and cleaning;
placement: checking a map against its model, once per load; devices: how a device is spelled; tied_params:
shared weights; tensors: moving one tensor; checkpoints: reading and sharding checkpoints. The helpers reading
a hooked model's offloaded weights live in ``notebook_accel.hooks.offloaded`` and are resolved from here.

Beyond Accelerate's names: ``plan_device_map`` returns a ``DeviceMapPlan`` (the map plus per-device bytes,
reserved room and, with ``verbose``, the decisions; it renders as an HTML table in a notebook);
``resolve_device_map`` turns a strategy ("auto", "balanced", "balanced_low_0", "sequential"; checked by
``check_strategy``) into a device map; ``find_checkpoint_files`` resolves the four checkpoint forms. For "disk" entries of a safetensors
checkpoint, ``load_checkpoint_in_model`` writes only ``<offload_folder>/index.json`` with entries
``{"safetensors_file", "weight_name", "dtype", "shape"}`` that the offload weights map reads in place.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .._lazy import attach
from .checkpoint_io.checkpoints import (
    find_checkpoint_files,
    load_checkpoint_in_model,
    load_state_dict,
    shard_checkpoint,
)
from .constants import SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from .device_planning.allocation import (
    check_device_same,
    check_tied_parameters_in_config,
    fallback_allocate,
    get_module_leaves,
    get_module_size_with_ties,
    get_non_persistent_buffers,
)
from .device_planning.device_map import (
    DeviceMapPlan,
    check_device_map,
    clean_device_map,
    infer_auto_device_map,
    plan_device_map,
    resolve_device_map,
)
from .device_planning.device_memory import get_balanced_memory, get_max_memory
from .device_planning.sizes import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    get_max_layer_size,
    named_module_tensors,
)
from .device_planning.tensors import id_tensor_storage, set_module_tensor_to_device
from .device_planning.tied_params import (
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    retie_parameters,
)
from .enums import CustomDtype, DistributedType
from .grad_scaler import get_grad_scaler
from .imports import (
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_npu_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xpu_available,
)
from .kwargs import AutocastKwargs
from .memory import clear_device_cache
from .offload import load_offloaded_weight, load_offloaded_weights, offload_weight, save_offload_index
from .other import _accelerator_state, is_peft_model
from .package_checks import is_peft_available, is_tqdm_available
from .tqdm import tqdm
from .versions import is_torch_version

__all__ = [
    "DeviceMapPlan",
    "calculate_maximum_sizes",
    "check_device_map",
    "check_tied_parameters_on_same_device",
    "clean_device_map",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "find_checkpoint_files",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "get_mixed_precision_context_manager",
    "id_tensor_storage",
    "infer_auto_device_map",
    "load_checkpoint_in_model",
    "load_state_dict",
    "named_module_tensors",
    "plan_device_map",
    "resolve_device_map",
    "retie_parameters",
    "set_module_tensor_to_device",
    "shard_checkpoint",
    # Accelerate 1.15 names of utils.modeling (defined in the topic modules imported above)
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "AutocastKwargs",
    "CustomDtype",
    "DistributedType",
    "check_device_same",
    "check_tied_parameters_in_config",
    "clear_device_cache",
    "fallback_allocate",
    "get_grad_scaler",
    "get_module_leaves",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "is_hpu_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_npu_available",
    "is_peft_available",
    "is_peft_model",
    "is_sdaa_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_tqdm_available",
    "is_xpu_available",
    "load_offloaded_weight",
    "load_offloaded_weights",
    "offload_weight",
    "save_offload_index",
    "tqdm",
]

# Accelerate documents these in utils.modeling; they read hooks, so they live in the hooks package and
# are resolved at first use (a lazy table entry, not an import: utils stays below hooks).
_FROM_HOOKS = dict.fromkeys(
    (
        "align_module_device",
        "get_state_dict_from_offload",
        "get_state_dict_offloaded_model",
        "has_offloaded_params",
    ),
    "notebook_accel.hooks.offloaded",
)
_FROM_HOOKS["AcceleratorState"] = (
    "notebook_accel.state"  # served here by Accelerate too; state is above utils
)
__all__ += sorted(_FROM_HOOKS)
__getattr__, __dir__ = attach(__name__, _FROM_HOOKS)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None):
    """Return a ``torch.autocast`` context for the current state's mixed precision, or a null context.

    ``native_amp`` False (or mixed precision "no"/"fp8") gives ``contextlib.nullcontext()``; ``autocast_kwargs``
    is an ``AutocastKwargs`` (or dict) whose non-default fields are passed to ``torch.autocast``.
    """
    if not native_amp:
        return contextlib.nullcontext()
    state = _accelerator_state()
    precision = getattr(state, "mixed_precision", "no")
    precision = str(getattr(precision, "value", precision))
    if precision not in ("fp16", "bf16"):
        return contextlib.nullcontext()
    if autocast_kwargs is None:
        kwargs: dict[str, Any] = {}
    elif isinstance(autocast_kwargs, dict):
        kwargs = dict(autocast_kwargs)
    else:
        kwargs = autocast_kwargs.to_kwargs()
    device_type = state.device.type if state.device is not None else "cpu"
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device_type=device_type, dtype=dtype, **kwargs)
