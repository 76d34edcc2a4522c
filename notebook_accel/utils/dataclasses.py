"""``accelerate.utils.dataclasses``: Accelerate keeps its configuration classes in one module; ours live in
small topic modules (kwargs, fp8_recipes, plugins, configs, enums, constants...). This module serves
them at Accelerate's path, each loaded the first time it is asked for.
"""

from __future__ import annotations

from .._lazy import attach

_TABLE: dict[str, str] = {
    "AORecipeKwargs": "notebook_accel.utils.fp8_recipes",
    "AutocastKwargs": "notebook_accel.utils.kwargs",
    "BETA_CP_AVAILABLE_PYTORCH_VERSION": "notebook_accel.utils.constants",
    "BETA_TP_AVAILABLE_PYTORCH_VERSION": "notebook_accel.utils.constants",
    "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION": "notebook_accel.utils.constants",
    "BaseEnum": "notebook_accel.utils.enums",
    "BnbQuantizationConfig": "notebook_accel.utils.configs",
    "ComputeEnvironment": "notebook_accel.utils.enums",
    "CustomDtype": "notebook_accel.utils.enums",
    "DDPCommunicationHookType": "notebook_accel.utils.enums",
    "DataLoaderConfiguration": "notebook_accel.utils.configs",
    "DeepSpeedPlugin": "notebook_accel.utils.plugins",
    "DeepSpeedSequenceParallelConfig": "notebook_accel.utils.parallelism",
    "DistributedDataParallelKwargs": "notebook_accel.utils.kwargs",
    "DistributedType": "notebook_accel.utils.enums",
    "DynamoBackend": "notebook_accel.utils.enums",
    "EnumWithContains": "notebook_accel.utils.enums",
    "FP8BackendType": "notebook_accel.utils.enums",
    "FP8RecipeKwargs": "notebook_accel.utils.fp8_recipes",
    "FSDP2_PYTORCH_VERSION": "notebook_accel.utils.constants",
    "FSDP_AUTO_WRAP_POLICY": "notebook_accel.utils.constants",
    "FSDP_BACKWARD_PREFETCH": "notebook_accel.utils.constants",
    "FSDP_SHARDING_STRATEGY": "notebook_accel.utils.constants",
    "FullyShardedDataParallelPlugin": "notebook_accel.utils.plugins",
    "GradScalerKwargs": "notebook_accel.utils.kwargs",
    "GradientAccumulationPlugin": "notebook_accel.utils.plugins",
    "InitProcessGroupKwargs": "notebook_accel.utils.kwargs",
    "KwargsHandler": "notebook_accel.utils.kwargs",
    "LoggerType": "notebook_accel.utils.enums",
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": "notebook_accel.utils.constants",
    "MSAMPRecipeKwargs": "notebook_accel.utils.fp8_recipes",
    "MegatronLMPlugin": "notebook_accel.utils.plugins",
    "PrecisionType": "notebook_accel.utils.enums",
    "ProfileKwargs": "notebook_accel.utils.kwargs",
    "ProjectConfiguration": "notebook_accel.utils.configs",
    "RNGType": "notebook_accel.utils.enums",
    "SageMakerDistributedType": "notebook_accel.utils.enums",
    "TERecipeKwargs": "notebook_accel.utils.fp8_recipes",
    "TensorInformation": "notebook_accel.utils.operations",
    "TorchContextParallelConfig": "notebook_accel.utils.parallelism",
    "TorchDynamoPlugin": "notebook_accel.utils.plugins",
    "TorchTensorParallelConfig": "notebook_accel.utils.parallelism",
    "TorchTensorParallelPlugin": "notebook_accel.utils.plugins",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": "notebook_accel.utils.constants",
    "compare_versions": "notebook_accel.utils.versions",
    "get_module_class_from_name": "notebook_accel.utils.other",
    "is_cuda_available": "notebook_accel.utils.imports",
    "is_hpu_available": "notebook_accel.utils.imports",
    "is_mlu_available": "notebook_accel.utils.imports",
    "is_msamp_available": "notebook_accel.utils.imports",
    "is_musa_available": "notebook_accel.utils.imports",
    "is_neuron_available": "notebook_accel.utils.imports",
    "is_npu_available": "notebook_accel.utils.imports",
    "is_rocm_available": "notebook_accel.utils.imports",
    "is_torch_version": "notebook_accel.utils.imports",
    "is_torchao_available": "notebook_accel.utils.package_checks",
    "is_transformer_engine_available": "notebook_accel.utils.imports",
    "is_xpu_available": "notebook_accel.utils.imports",
    "parse_flag_from_env": "notebook_accel.utils.environment",
    "str_to_bool": "notebook_accel.utils.environment",
}

__all__ = sorted(_TABLE)
__getattr__, __dir__ = attach(__name__, _TABLE)
