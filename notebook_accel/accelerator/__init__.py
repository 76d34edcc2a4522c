"""``Accelerator``, at the path Accelerate users import (``accelerate.accelerator``).

- :mod:`.flags`: the user's constructor flags, resolved and checked;
- :mod:`.wrapping`: which wrapper a model gets (DDP, FSDP, torch.compile, DeepSpeed);
- :mod:`.checkpoint`: ``save_state`` / ``load_state`` and the objects registered for checkpointing;
- :mod:`.tracking`: the experiment trackers an accelerator logs to;
- :mod:`.core`: the ``Accelerator`` class, a thin face over the above.

This package never imports hooks, big_modeling or the launcher (see docs/architecture.md).
"""

from __future__ import annotations

from .._lazy import attach
from ..logging import get_logger
from ..optimizer import AcceleratedOptimizer
from ..parallelism_config import ParallelismConfig
from ..scheduler import AcceleratedScheduler
from ..state import AcceleratorState, GradientState, PartialState
from ..utils.compilation import (
    compile_regions,
    compile_regions_deepspeed,
    compile_regions_fsdp2,
    is_compiled_module,
)
from ..utils.configs import DataLoaderConfiguration, ProjectConfiguration
from ..utils.constants import (
    DTENSOR_PYTORCH_VERSION,
    FSDP2_PYTORCH_VERSION,
    FSDP_PYTORCH_VERSION,
    MODEL_NAME,
    PROFILE_PATTERN_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    SCALER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
)
from ..utils.enums import DistributedType, DynamoBackend, FP8BackendType, LoggerType, PrecisionType, RNGType
from ..utils.environment import parse_choice_from_env
from ..utils.grad_scaler import get_grad_scaler
from ..utils.imports import (
    is_bf16_available,
    is_mlu_available,
    is_musa_available,
    is_npu_available,
    is_torch_xla_available,
    is_xpu_available,
)
from ..utils.memory import release_memory
from ..utils.package_checks import (
    is_bitsandbytes_multi_backend_available,
    is_deepspeed_available,
    is_lomo_available,
    is_megatron_lm_available,
    is_msamp_available,
    is_torchao_available,
    is_transformer_engine_available,
)
from ..utils.plugins import GradientAccumulationPlugin, TorchDynamoPlugin, TorchTensorParallelPlugin
from ..utils.versions import compare_versions, is_torch_version
from .core import Accelerator

# Besides Accelerator, the names code written for Accelerate imports from accelerate.accelerator.
__all__ = [
    "AcceleratedOptimizer",
    "AcceleratedScheduler",
    "Accelerator",
    "AcceleratorState",
    "GradientState",
    "PrecisionType",
]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "DTENSOR_PYTORCH_VERSION",
    "DistributedType",
    "DynamoBackend",
    "FP8BackendType",
    "FSDP2_PYTORCH_VERSION",
    "FSDP_PYTORCH_VERSION",
    "GradientAccumulationPlugin",
    "LoggerType",
    "MODEL_NAME",
    "PROFILE_PATTERN_NAME",
    "PartialState",
    "ProjectConfiguration",
    "RNGType",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SCALER_NAME",
    "TorchDynamoPlugin",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "compare_versions",
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "get_grad_scaler",
    "get_logger",
    "is_bf16_available",
    "is_bitsandbytes_multi_backend_available",
    "is_compiled_module",
    "is_deepspeed_available",
    "is_lomo_available",
    "is_megatron_lm_available",
    "is_mlu_available",
    "is_msamp_available",
    "is_musa_available",
    "is_npu_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_transformer_engine_available",
    "is_xpu_available",
    "parse_choice_from_env",
    "release_memory",
]
# The engines' configurations and FSDP helpers (issue 15).
__all__ += [
    "DataLoaderConfiguration",
    "ParallelismConfig",
    "TorchTensorParallelPlugin",
]
_REEXPORTED_LAZILY = {
    "get_state_dict_offloaded_model": "notebook_accel.hooks.offloaded",
    "has_offloaded_params": "notebook_accel.hooks.offloaded",
}
# The engines' helpers load their engine (torch.distributed.fsdp, DTensor...): served at first use, so that
# importing the Accelerator costs none of it.
_REEXPORTED_LAZILY.update(
    {
        "DeepSpeedPlugin": "notebook_accel.integrations.deepspeed.plugin",
        "FullyShardedDataParallelPlugin": "notebook_accel.integrations.fsdp.plugin",
        "MegatronLMPlugin": "notebook_accel.integrations.megatron.plugin",
        "get_mixed_precision_context_manager": "notebook_accel.utils.modeling",
    }
    | dict.fromkeys(
        ("load_accelerator_state", "load_custom_state", "save_accelerator_state", "save_custom_state"),
        "notebook_accel.checkpointing",
    )
    | dict.fromkeys(
        ("AORecipeKwargs", "FP8RecipeKwargs", "MSAMPRecipeKwargs", "TERecipeKwargs"),
        "notebook_accel.integrations.fp8.recipes",
    )
    | dict.fromkeys(("convert_model_to_fp8_ao",), "notebook_accel.integrations.fp8.ao")
    # The tensor operations, the data loaders and the trackers load at first use (issue 21).
    | dict.fromkeys(
        (
            "convert_outputs_to_fp32",
            "gather",
            "gather_object",
            "pad_across_processes",
            "recursively_apply",
            "reduce",
        ),
        "notebook_accel.utils.operations",
    )
    | dict.fromkeys(
        (
            "AutocastKwargs",
            "DistributedDataParallelKwargs",
            "GradScalerKwargs",
            "InitProcessGroupKwargs",
            "KwargsHandler",
            "ProfileKwargs",
        ),
        "notebook_accel.utils.kwargs",
    )
    | dict.fromkeys(
        (
            "check_os_kernel",
            "clean_state_dict_for_safetensors",
            "extract_model_from_parallel",
            "get_model_tp_size",
            "get_pretty_name",
            "model_has_dtensor",
            "save",
            "wait_for_everyone",
        ),
        "notebook_accel.utils.other",
    )
    | dict.fromkeys(
        ("DataLoaderDispatcher", "prepare_data_loader", "skip_first_batches"), "notebook_accel.data_loader"
    )
    | dict.fromkeys(("GeneralTracker", "LOGGER_TYPE_TO_CLASS", "filter_trackers"), "notebook_accel.tracking")
    | dict.fromkeys(
        ("apply_fp8_autowrap", "convert_model"), "notebook_accel.integrations.fp8.transformer_engine"
    )
    | dict.fromkeys(
        ("load_fsdp_model", "load_fsdp_optimizer", "save_fsdp_model", "save_fsdp_optimizer"),
        "notebook_accel.integrations.fsdp.checkpoints",
    )
    | dict.fromkeys(
        (
            "ensure_weights_retied",
            "fsdp2_apply_ac",
            "fsdp2_canonicalize_names",
            "fsdp2_prepare_model",
            "fsdp2_switch_optimizer_parameters",
            "get_fsdp2_grad_scaler",
        ),
        "notebook_accel.integrations.fsdp.fsdp2",
    )
)
# Every name served lazily is public here too: the table is its one list.
__all__ += sorted(set(_REEXPORTED_LAZILY) - set(__all__))
__getattr__, __dir__ = attach(__name__, _REEXPORTED_LAZILY)
