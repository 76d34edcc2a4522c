"""Run models bigger than a device: empty init, CPU/disk offload, dispatch over a device map, quantized loading.

- ``empty``: ``init_empty_weights`` / ``init_on_device``;
- ``offload``: ``cpu_offload``, ``disk_offload``, ``cpu_offload_with_hook``;
- ``dispatch``: ``dispatch_model``, ``load_checkpoint_and_dispatch``;
- ``quantize``: ``load_and_quantize_model`` (bitsandbytes; listed by ``notebook_accel.utils``).

Offloaded weights are read through a lazy weights map (CPU tensors, memory-mapped offload files
or the checkpoint's own safetensors files) by ``AlignDevicesHook``s, and a background
:class:`~notebook_accel.hooks.prefetch.Prefetcher` loads the next block while the current one
computes (``prefetch=False`` turns it off; ``prefetch=2`` keeps two blocks ahead).

The way back: ``remove_hook_from_submodules(model)`` (plus ``remove_hook_from_module(model)``)
detaches every hook, joins the prefetch thread and materialises offloaded weights where they are
stored (CPU tensors; memory-mapped CPU tensors for disk), so the model then runs without hooks.
Until then, ``model.to(device)`` on a model dispatched with offloaded weights raises (and warns
otherwise), as in Accelerate.
"""

from __future__ import annotations

from .._lazy import attach
from ..hooks import attach_layerwise_casting_hooks
from ..hooks.align import LayerwiseCastingHook
from ..utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
from ..utils.device_info import check_cuda_p2p_ib_support
from ..utils.device_planning.device_map import infer_auto_device_map
from ..utils.device_planning.device_memory import get_balanced_memory
from ..utils.device_planning.tied_params import retie_parameters
from ..utils.imports import (
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_sdaa_available,
    is_xpu_available,
)
from ..utils.package_checks import is_bnb_available
from .dispatch import dispatch_model, load_checkpoint_and_dispatch
from .empty import init_empty_weights, init_on_device
from .offload import cpu_offload, cpu_offload_with_hook, disk_offload

__all__ = [
    "init_empty_weights",
    "init_on_device",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "LayerwiseCastingHook",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "check_cuda_p2p_ib_support",
    "get_balanced_memory",
    "infer_auto_device_map",
    "is_bnb_available",
    "is_mlu_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_sdaa_available",
    "is_xpu_available",
    "retie_parameters",
]

# Names Accelerate's big_modeling module also exposes (its own imports): same objects, resolved at
# first use from their homes.
_ALSO_HERE = {
    **dict.fromkeys(
        (
            "AlignDevicesHook",
            "CpuOffload",
            "UserCpuOffloadHook",
            "add_hook_to_module",
            "attach_align_device_hook",
            "attach_align_device_hook_on_blocks",
        ),
        "notebook_accel.hooks",
    ),
    "OffloadedWeightsLoader": "notebook_accel.utils.offload",
    "extract_submodules_state_dict": "notebook_accel.utils.offload",
    "offload_state_dict": "notebook_accel.utils.offload",
    "check_device_map": "notebook_accel.utils.device_planning.placement",
    "find_tied_parameters": "notebook_accel.utils.device_planning.tied_params",
    "load_checkpoint_in_model": "notebook_accel.utils.checkpoint_io.checkpoints",
    "parse_flag_from_env": "notebook_accel.utils.environment",
    # utils.other reads the process state: importing it here would load the state, the plugins and
    # torch.distributed.fsdp for every big-model import (tests/test_big_modeling_import.py).
    "recursive_getattr": "notebook_accel.utils.other",
    # Accelerate 1.15's tests import this private check from here.
    "_refuse_recurrent_layers_under_sequence_parallelism": "notebook_accel.utils._sequence_parallel",
}
__all__ += ["recursive_getattr"]
__getattr__, __dir__ = attach(__name__, _ALSO_HERE)
