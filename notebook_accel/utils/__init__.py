"""Everything documented as ``accelerate.utils.X``, loaded lazily from small topic modules."""

from __future__ import annotations

from .._lazy import attach

_TABLE: dict[str, str] = {}


def _add(module: str, *names: str) -> None:
    for name in names:
        _TABLE[name] = module


# DeepSpeed config parsing and placeholders (running DeepSpeed needs `pip install deepspeed`)
_add(
    "..integrations.deepspeed.config",
    "HfDeepSpeedConfig",
    "DummyOptim",
    "DummyScheduler",
    "DeepSpeedEngineWrapper",
    "DeepSpeedOptimizerWrapper",
    "DeepSpeedSchedulerWrapper",
    "get_active_deepspeed_plugin",
    "map_pytorch_optim_to_deepspeed",
)
# constants
_add(
    ".constants",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "SAMPLER_NAME",
    "WEIGHTS_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_MODEL_NAME",
    "WEIGHTS_PATTERN_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
)
# enums
_add(
    ".enums",
    "ComputeEnvironment",
    "DistributedType",
    "DynamoBackend",
    "LoggerType",
    "PrecisionType",
    "RNGType",
    "SageMakerDistributedType",
)
# kwargs handlers
_add(
    ".kwargs",
    "KwargsHandler",
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
)
# plugins
_add(".plugins", "GradientAccumulationPlugin", "TorchDynamoPlugin", "TorchTensorParallelPlugin")
_add("..integrations.deepspeed.plugin", "DeepSpeedPlugin")
_add("..integrations.fsdp.plugin", "FullyShardedDataParallelPlugin")
_add("..integrations.megatron.plugin", "MegatronLMPlugin")
_add(
    "..integrations.fsdp.checkpoints",
    "save_fsdp_model",
    "load_fsdp_model",
    "save_fsdp_optimizer",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "enable_fsdp_ram_efficient_loading",
    "disable_fsdp_ram_efficient_loading",
)
_add(
    "..integrations.fsdp.fsdp2",
    "ensure_weights_retied",
    "fsdp2_apply_ac",
    "fsdp2_canonicalize_names",
    "fsdp2_load_full_state_dict",
    "fsdp2_prepare_model",
    "fsdp2_switch_optimizer_parameters",
    "get_fsdp2_grad_scaler",
)
# ParallelismConfig lives at Accelerate's accelerate.parallelism_config, above utils (served lazily)
_add(
    "..parallelism_config",
    "ParallelismConfig",
    "TorchTensorParallelConfig",
    "TorchContextParallelConfig",
    "DeepSpeedSequenceParallelConfig",
)
# configurations
_add(".configs", "BnbQuantizationConfig", "ProjectConfiguration", "DataLoaderConfiguration")
# environment variables and manipulation
_add(
    ".environment",
    "ACCELERATE_DEBUG_MODE",
    "patch_environment",
    "clear_environment",
    "str_to_bool",
    "parse_flag_from_env",
    "get_int_from_env",
)
_add(".config_file", "write_basic_config", "default_config_file")
# environment checks
_add(
    ".imports",
    "is_bf16_available",
    "is_ipex_available",
    "is_mps_available",
    "is_npu_available",
    "is_torch_version",
    "is_tpu_available",
    "is_xpu_available",
    "is_cuda_available",
    "is_torch_xla_available",
    "is_bnb_available",
    "is_deepspeed_available",
    "is_megatron_lm_available",
    "is_safetensors_available",
    "is_ipython_available",
    "is_tqdm_available",
    "is_tensorboard_available",
    "is_wandb_available",
    "is_comet_ml_available",
    "is_mlflow_available",
    "is_aim_available",
    "is_clearml_available",
    "is_dvclive_available",
    "is_transformer_engine_available",
    "is_msamp_available",
)
# data operations: the collectives read the process state (utils.operations imports it); the
# structure helpers are named at their state-free home, so that e.g. send_to_device costs no state.
_add(
    ".operations",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
    "DistributedOperationException",
    "CannotPadNestedTensorWarning",
    "GatheredParameters",
    "copy_tensor_to_devices",
)
_add(
    "._ops_structure",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "listify",
    "recursively_apply",
    "send_to_device",
    "slice_tensors",
    "find_batch_size",
    "honor_type",
    "is_tensor_information",
    "initialize_tensors",
    "get_data_structure",
    "ignorant_find_batch_size",
    "TensorInformation",
    "is_torch_tensor",
    "find_device",
    "is_namedtuple",
    "pad_input_tensors",
)
# memory
_add(
    ".memory",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
    "clear_device_cache",
)
# modeling: sizes, device maps, tensors, checkpoints. Each name points at its topic module, not at
# the `utils.modeling` face: that face also serves get_mixed_precision_context_manager, which reads
# the process state, and a big-model name must not load the state (tests/test_big_modeling_import.py).
_add(
    ".device_planning.sizes",
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "get_max_layer_size",
    "named_module_tensors",
    "dtype_byte_size",
    "convert_file_size_to_int",
)
_add(".device_planning.device_memory", "get_balanced_memory", "get_max_memory")
_add(".device_planning.device_map", "infer_auto_device_map", "clean_device_map")
_add(".device_planning.placement", "check_device_map")
_add(".checkpoint_io.checkpoints", "load_checkpoint_in_model", "load_state_dict", "shard_checkpoint")
_add(
    ".device_planning.tied_params",
    "retie_parameters",
    "find_tied_parameters",
    "check_tied_parameters_on_same_device",
)
_add(".device_planning.tensors", "set_module_tensor_to_device", "id_tensor_storage")
_add(".modeling", "get_mixed_precision_context_manager")
# offload
_add(
    ".offload",
    "load_offloaded_weights",
    "offload_state_dict",
    "offload_weight",
    "load_offloaded_weight",
    "save_offload_index",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "extract_submodules_state_dict",
)
# helpers reading a hooked module's offloaded weights: they live with the hooks (a table entry is
# resolved at first use, so utils imports nothing from the hooks package)
_add("..hooks.offloaded", "has_offloaded_params", "align_module_device", "get_state_dict_offloaded_model")
# parallel and misc
_add(".other", "extract_model_from_parallel", "save", "wait_for_everyone", "merge_dicts", "get_pretty_name")
# random
_add(".random", "set_seed", "synchronize_rng_state", "synchronize_rng_states")
# XLA and quantization
_add("..integrations.xla", "install_xla")
_add("..integrations.quantization.quantize", "load_and_quantize_model")
# Accelerate 1.15 names (issue 12)
_add(
    ".constants",
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "PROFILE_PATTERN_NAME",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "TORCH_LAUNCH_PARAMS",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
)
_add(".enums", "CustomDtype", "DDPCommunicationHookType")
_add(
    ".imports",
    "deepspeed_required",
    "is_fp16_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_neuron_available",
    "is_rocm_available",
    "is_sdaa_available",
    "is_weights_only_available",
    "is_xccl_available",
    "torchao_required",
)
_add(
    ".package_checks",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_amdsmi_available",
    "is_bitsandbytes_multi_backend_available",
    "is_boto3_available",
    "is_datasets_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_swanlab_available",
    "is_timm_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
)
_add(".versions", "compare_versions")
_add(".grad_scaler", "get_grad_scaler")
_add(".other", "is_peft_model")
_add(".device_planning.allocation", "check_tied_parameters_in_config")
_add(".tqdm", "tqdm")
_add(
    ".compilation",
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "has_compiled_regions",
    "is_compiled_module",
)
_add(
    ".device_info",
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "get_current_device_type",
    "get_gpu_info",
    "set_numa_affinity",
)
_add(
    ".environment",
    "are_libraries_initialized",
    "convert_dict_to_env_variables",
    "get_cpu_distributed_information",
    "parse_choice_from_env",
    "purge_accelerate_environment",
)
_add(".network", "is_port_in_use")
_add(
    ".other",
    "check_os_kernel",
    "clean_state_dict_for_safetensors",
    "convert_bytes",
    "get_model_tp_size",
    "get_module_children_bottom_up",
    "load",
    "model_has_dtensor",
    "recursive_getattr",
)
_add("..integrations.fp8.recipes", "AORecipeKwargs", "FP8RecipeKwargs", "MSAMPRecipeKwargs", "TERecipeKwargs")
_add(
    ".launch",
    "PrepareForLaunch",
    "prepare_deepspeed_cmd_env",
    "prepare_multi_gpu_env",
    "prepare_sagemager_args_inputs",
    "prepare_simple_launcher_cmd_env",
    "prepare_tpu",
)
_add(
    "..integrations.fp8.ao", "convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "has_ao_layers"
)
_add(
    "..integrations.fp8.transformer_engine",
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "has_transformer_engine_layers",
)
_add("..integrations.megatron.config", "add_model_config_to_megatron_parser")
# Megatron-LM's placeholders, train steps and loss averaging (running Megatron needs megatron-core)
_add(
    "..integrations.megatron.lm",
    "AbstractTrainStep",
    "BertTrainStep",
    "GPTTrainStep",
    "MegatronLMDummyDataLoader",
    "MegatronLMDummyScheduler",
    "T5TrainStep",
    "avg_losses_across_data_parallel_group",
)
_add("..integrations.quantization.bnb", "has_4bit_bnb_layers")

__all__ = sorted(_TABLE)
__getattr__, __dir__ = attach(__name__, _TABLE)
