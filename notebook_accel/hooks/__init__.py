"""Forward hooks that see args and kwargs, and the device hooks that run big models.

The package, bottom up (each module imports only those above it in this list, and ``utils``):

- ``events``: the telemetry bus (a leaf; published as ``notebook_accel.telemetry``);
- ``base``: the hook protocol (:class:`ModelHook`, :class:`SequentialHook`) and putting a hook on a
  module or taking it off (:func:`add_hook_to_module`, :func:`remove_hook_from_module`);
- ``align``: hooks that place weights (:class:`AlignDevicesHook`, :class:`LayerwiseCastingHook`,
  :class:`CpuOffload` and its :class:`UserCpuOffloadHook` handle);
- ``offloaded``: questions about offloaded weights (``has_offloaded_params``,
  ``align_module_device``, ``get_state_dict_offloaded_model``, ``weight_placement``);
- ``schedule``: the streaming offload's schedule as plain logic (which copy when, which buffer);
- ``host_pack``: a unit's offloaded weights packed into one pinned host block;
- ``streaming``: the streamer and its CUDA copy engine (side stream, events, pooled buffers);
- ``prefetch``: the background loader of the next offloaded block, and the streaming entry point;
- ``attach``: hooking a whole model (``attach_*``).

``big_modeling`` (``cpu_offload``, ``dispatch_model``...) builds on this package.
"""

from __future__ import annotations

from .._lazy import attach as _lazy_attach
from ..utils._ops_structure import find_device, send_to_device
from ..utils.device_planning.allocation import get_non_persistent_buffers
from ..utils.device_planning.sizes import named_module_tensors
from ..utils.device_planning.tensors import set_module_tensor_to_device
from ..utils.imports import is_mlu_available, is_musa_available, is_npu_available
from ..utils.memory import clear_device_cache
from ..utils.offload import PrefixedDataset
from .align import AlignDevicesHook, CpuOffload, LayerwiseCastingHook, UserCpuOffloadHook
from .attach import (
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    attach_layerwise_casting_hooks,
)
from .base import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)

__all__ = [
    "ModelHook",
    "SequentialHook",
    "AlignDevicesHook",
    "LayerwiseCastingHook",
    "UserCpuOffloadHook",
    "CpuOffload",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "attach_execution_device_hook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_layerwise_casting_hooks",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "PrefixedDataset",
    "clear_device_cache",
    "find_device",
    "get_non_persistent_buffers",
    "is_mlu_available",
    "is_musa_available",
    "is_npu_available",
    "named_module_tensors",
    "send_to_device",
    "set_module_tensor_to_device",
]
# hooks sit below state (they never import it); Accelerate's hooks module also serves PartialState,
# and recursive_getattr, whose home utils.other reads the state: both resolved at first use.
_REEXPORTED_LAZILY = {
    "PartialState": "notebook_accel.state",
    "recursive_getattr": "notebook_accel.utils.other",
}
__all__ += sorted(_REEXPORTED_LAZILY)
__getattr__, __dir__ = _lazy_attach(__name__, _REEXPORTED_LAZILY)
