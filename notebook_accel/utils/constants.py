"""Accelerate's named constants: checkpoint file names, version thresholds, launcher parameters.

The values are Accelerate 1.15's (facts recorded in tests/data/accelerate_surface.json).
"""

from __future__ import annotations

import operator

from torch import nn

__all__ = [
    "BETA_CP_AVAILABLE_PYTORCH_VERSION",
    "BETA_SP_AVAILABLE_DEEPSPEED_VERSION",
    "BETA_TP_AVAILABLE_PYTORCH_VERSION",
    "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION",
    "CUDA_DISTRIBUTED_TYPES",
    "DEEPSPEED_MULTINODE_LAUNCHERS",
    "DTENSOR_PYTORCH_VERSION",
    "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION",
    "FSDP2_PYTORCH_VERSION",
    "FSDP2_STATE_DICT_TYPE",
    "FSDP_AUTO_WRAP_POLICY",
    "FSDP_BACKWARD_PREFETCH",
    "FSDP_MODEL_NAME",
    "FSDP_PYTORCH_VERSION",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_STATE_DICT_TYPE",
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "PROFILE_PATTERN_NAME",
    "SAGEMAKER_PARALLEL_EC2_INSTANCES",
    "SAGEMAKER_PYTHON_VERSION",
    "SAGEMAKER_PYTORCH_VERSION",
    "SAGEMAKER_TRANSFORMERS_VERSION",
    "STR_OPERATION_TO_FUNC",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "TORCH_DYNAMO_MODES",
    "TORCH_LAUNCH_PARAMS",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
]

# Used by Accelerator.save_state / load_state.
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
RNG_STATE_NAME = "random_states"
SCALER_NAME = "scaler.pt"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"

# Used by Accelerator.save_model and the checkpoint loaders.
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
# Shard names: format with ``suffix="-00001-of-00003"``.
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
# Accelerator.profile writes one trace per process: format with ``suffix=<process index>``.
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

# The comparison operators compare_versions / is_torch_version accept.
STR_OPERATION_TO_FUNC = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}

# Minimum versions for features (compare with is_torch_version / compare_versions).
FSDP2_PYTORCH_VERSION = "2.6.0"
DTENSOR_PYTORCH_VERSION = "2.5.0"
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"

FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]

# FullyShardedDataParallelPlugin's accepted names (the index + 1 of a sharding strategy is its torch
# ShardingStrategy value, which is how transformers maps its fsdp options onto the plugin).
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
# Minimum torch for FSDP (a pre-release build string, as Accelerate pins it) and the checkpoint name stem.
FSDP_PYTORCH_VERSION = "2.1.0.a0+32f93b1"
FSDP_MODEL_NAME = "pytorch_model_fsdp"
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]

# SageMaker launch defaults.
SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"
SAGEMAKER_PARALLEL_EC2_INSTANCES = ["ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4dn.24xlarge"]

DEEPSPEED_MULTINODE_LAUNCHERS = ["pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm"]
# The torchrun options a launch command forwards (the rest are the script's).
TORCH_LAUNCH_PARAMS = [
    "nnodes",
    "nproc_per_node",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "m",
    "no_python",
    "run_path",
    "log_dir",
    "r",
    "redirects",
    "t",
    "tee",
    "node_rank",
    "master_addr",
    "master_port",
]

# DistributedType values (as strings) that run on CUDA devices / go through torch.distributed.
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = CUDA_DISTRIBUTED_TYPES + [
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_CPU",
    "MULTI_HPU",
    "MULTI_NEURON",
]

# Layers whose weights layer-wise casting stores in a low-precision dtype and upcasts per forward.
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)
