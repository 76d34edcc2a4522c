"""Every option of ``accelerate launch`` (1.15), in its help group, with 1.15's names, types and defaults.

The options are data: one table per help group, each row the flags and the ``add_argument`` settings.
tests/test_cli_options.py holds the parser built from them to the facts recorded from 1.15
(tests/data/cli_options_1_15.json, scripts/record_cli_options.py). The help texts are ours.
Long options also accept dashes (``--num-processes``).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..utils.constants import TORCH_DYNAMO_MODES
from ..utils.enums import MIXED_PRECISION_CHOICES
from ..utils.environment import str_to_bool
from .utils import _with_dashed_twins

__all__ = ["LAUNCH_OPTION_GROUPS", "add_launch_options", "bool_triple"]

# The ``--dynamo_backend`` choices of 1.15's command line, spelled as it spells them.
_DYNAMO_CHOICES = ["no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs",
                   "ofi", "fx2trt", "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torhchxla_trace_once",
                   "tvm"]  # fmt: skip


def bool_triple(text: str) -> tuple[int, ...]:
    """Return ``"true,false,true"`` as ``(1, 0, 1)``: one ``str_to_bool`` per comma-separated item."""
    return tuple(str_to_bool(item) for item in text.split(","))


def _flag(text: str, **extra: Any) -> dict[str, Any]:
    return {"action": "store_true", "help": text, **extra}


def _value(kind: Any, text: str, default: Any = None, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "default": default, "help": text, **extra}


def _engine_values(prefix: str, rows: str) -> tuple[tuple[tuple[str], dict[str, Any]], ...]:
    """Return option rows from ``"name type default | help"`` lines (``-``: no default), all under ``prefix``."""
    kinds = {"str": str, "int": int, "float": float, "bool": bool}
    out = []
    for line in rows.strip().splitlines():
        spec, _, text = line.partition("|")
        name, kind, default = spec.split()
        value = None if default == "-" else kinds[kind](default) if kind != "bool" else default == "True"
        out.append(((f"--{prefix}{name}",), _value(kinds[kind], text.strip(), value)))
    return tuple(out)


_GENERAL = (
    (("--config_file",), {"default": None, "help": "Config file whose values fill the options not given."}),
    (("--quiet", "-q"), _flag("Keep torchrun's own start-up lines out of the output.", default=None)),
    (("-m", "--module"), _flag("Run the script as a module (``python -m``).", default=None)),
    (
        ("--no_python",),
        _flag("Run the script as an executable, without the Python interpreter.", default=None),
    ),
    (("--debug",), _flag("Check the inputs of collectives (ACCELERATE_DEBUG_MODE).", default=None)),
)
_HARDWARE = (
    (("--cpu",), _flag("Train on the CPU even where accelerators are visible.", default=False)),
    (("--multi_gpu",), _flag("Data-parallel training over several GPUs.", default=False)),
    (("--tpu",), _flag("Train on TPU cores (torch_xla).", default=False)),
)
_RESOURCES = (
    (("--mixed_precision",), _value(str, "Mixed precision mode.", choices=list(MIXED_PRECISION_CHOICES))),
    (("--num_processes",), _value(int, "Processes to start, over all machines.")),
    (("--num_machines",), _value(int, "Machines taking part.")),
    (("--num_cpu_threads_per_process",), _value(int, "OpenMP threads per process (OMP_NUM_THREADS).")),
    (("--enable_cpu_affinity",), _flag("Pin each process to the cores near its accelerator.", default=False)),
    (("--dynamo_backend",), _value(str, "torch.compile backend, or 'no'.", choices=_DYNAMO_CHOICES)),
    (("--dynamo_mode",), _value(str, "torch.compile mode.", "default", choices=TORCH_DYNAMO_MODES)),
    (("--dynamo_use_fullgraph",), _flag("Compile each model as one graph.", default=False)),
    (("--dynamo_use_dynamic",), _flag("Compile with dynamic shapes.", default=False)),
    (("--dynamo_use_regional_compilation",), _flag("Compile the repeated blocks once each.", default=False)),
)
_PARADIGMS = (
    (("--use_deepspeed",), _flag("Train with DeepSpeed (the deepspeed package, CUDA).", default=False)),
    (("--use_fsdp",), _flag("Train with FullyShardedDataParallel.", default=False)),
    (("--use_parallelism_config",), _flag("Read the ParallelismConfig options below.", default=False)),
    (("--use_megatron_lm",), _flag("Train with Megatron-LM (megatron-core, CUDA).", default=False)),
)
_DISTRIBUTED = (
    (("--gpu_ids",), {"default": None, "help": "Comma-separated GPU ids of this machine to use."}),
    (("--same_network",), _flag("All machines are on one local network.", default=False)),
    (("--machine_rank",), _value(int, "This machine's rank (0: the main one).")),
    (("--main_process_ip",), _value(str, "Address of the machine of rank 0.")),
    (("--main_process_port",), _value(int, "Port on the machine of rank 0 for the rendezvous.")),
    (("-t", "--tee"), _value(str, "torchrun --tee: copy the chosen streams to the log files.", "0")),
    (("--log_dir",), _value(str, "torchrun --log_dir: folder of the per-process logs.")),
    (("--role",), _value(str, "torchrun --role of the workers.", "default")),
    (("--rdzv_backend",), _value(str, "torchrun rendezvous backend (static, c10d...).", "static")),
    (("--rdzv_conf",), _value(str, "torchrun rendezvous settings, key=value,...", "")),
    (("--max_restarts",), _value(int, "torchrun: restarts of the worker group before failing.", 0)),
    (("--monitor_interval",), _value(float, "torchrun: seconds between looks at the workers.", 0.1)),
)
_TPU = (
    (("--tpu_cluster",), _flag("Launch on a TPU pod.", dest="tpu_use_cluster", default=False)),
    (
        ("--no_tpu_cluster",),
        {
            "action": "store_const",
            "const": False,
            "default": True,
            "dest": "tpu_use_cluster",
            "help": "Launch on this TPU host only.",
        },
    ),  # fmt: skip
    (("--tpu_use_sudo",), _flag("Run the pod's commands with sudo.", default=False)),
    (("--vm",), {"type": str, "action": "append", "help": "A VM of the pod (repeat the option)."}),
    (("--env",), {"type": str, "action": "append", "help": "NAME=value for the pod's processes (repeat)."}),
    (("--main_training_function",), _value(str, "Name of the script's function a TPU launch calls.")),
    (("--downcast_bf16",), _flag("On TPU with bf16, keep float64 tensors as float32.", default=False)),
)
_DEEPSPEED = (
    (("--deepspeed_config_file",), _value(str, "DeepSpeed JSON config file.")),
    (("--zero_stage",), _value(int, "ZeRO stage (0 to 3).")),
    (
        ("--offload_optimizer_device",),
        _value(str, "Where ZeRO offloads the optimizer state (none, cpu, nvme)."),
    ),
    (("--offload_param_device",), _value(str, "Where ZeRO-3 offloads the parameters (none, cpu, nvme).")),
    (("--offload_optimizer_nvme_path",), _value(str, "NVMe folder for the offloaded optimizer state.")),
    (("--offload_param_nvme_path",), _value(str, "NVMe folder for the offloaded parameters.")),
    (("--gradient_accumulation_steps",), _value(int, "Steps each optimizer step accumulates.")),
    (("--gradient_clipping",), _value(float, "Clip the gradient norm at this value.")),
    (("--zero3_init_flag",), _value(str, "Build the model already partitioned (ZeRO-3): true/false.")),
    (("--zero3_save_16bit_model",), _value(str, "Gather a 16-bit model when saving (ZeRO-3): true/false.")),
    (("--deepspeed_hostfile",), _value(str, "DeepSpeed hostfile of the machines.")),
    (("--deepspeed_exclusion_filter",), _value(str, "DeepSpeed --exclude: hosts or GPUs left out.")),
    (("--deepspeed_inclusion_filter",), _value(str, "DeepSpeed --include: the only hosts or GPUs used.")),
    (("--deepspeed_multinode_launcher",), _value(str, "How DeepSpeed starts the other machines (pdsh...).")),
    (("--deepspeed_moe_layer_cls_names",), _value(str, "Comma-separated class names of MoE layers.")),
)
_FSDP = (
    (("--fsdp_version",), _value(str, "FSDP version: 1 or 2.", "1", choices=["1", "2"])),
    (
        ("--fsdp_offload_params",),
        _value(str, "Offload parameters and gradients to the CPU: true/false.", "false"),
    ),
    (("--fsdp_min_num_params",), _value(int, "Size-based wrapping: the smallest wrapped module.", 100000000)),
    (("--fsdp_sharding_strategy",), _value(str, "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD...", "FULL_SHARD")),
    (
        ("--fsdp_reshard_after_forward",),
        _value(str, "FSDP2: free the gathered weights after forward.", "true"),
    ),
    (("--fsdp_auto_wrap_policy",), _value(str, "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP.")),
    (("--fsdp_transformer_layer_cls_to_wrap",), _value(str, "Comma-separated block class names to wrap.")),
    (("--fsdp_backward_prefetch",), _value(str, "BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH.")),
    (("--fsdp_state_dict_type",), _value(str, "FULL_STATE_DICT or SHARDED_STATE_DICT in checkpoints.")),
    (
        ("--fsdp_forward_prefetch",),
        _value(str, "Prefetch the next all-gather in forward: true/false.", "false"),
    ),
    (("--fsdp_use_orig_params",), _value(str, "Keep the original parameters visible: true/false.", "true")),
    (
        ("--fsdp_cpu_ram_efficient_loading",),
        _value(str, "Load the weights on rank 0 only: true/false.", "true"),
    ),
    (("--fsdp_sync_module_states",), _value(str, "Broadcast rank 0's weights at wrap: true/false.", "true")),
    (("--fsdp_activation_checkpointing",), _value(str, "Recompute activations in backward.", "false")),
    (
        ("--fsdp_activation_checkpointing_offload",),
        _value(str, "Keep saved activations on the CPU.", "false"),
    ),
)
_MEGATRON = _engine_values(
    "megatron_lm_",
    """
tp_degree int 1 | Tensor-parallel degree.
use_custom_fsdp bool False | Use Megatron's own FSDP.
no_load_optim bool False | Do not load the optimizer state.
eod_mask_loss bool False | Mask the loss at end-of-document tokens.
overlap_cpu_optimizer_d2h_h2d bool False | Overlap the CPU optimizer's device copies.
no_save_optim bool False | Do not save the optimizer state.
optimizer_cpu_offload bool False | Run the optimizer on the CPU.
use_precision_aware_optimizer bool False | Keep optimizer state in reduced precision.
decoder_last_pipeline_num_layers int - | Layers of the last pipeline stage.
pp_degree int 1 | Pipeline-parallel degree.
num_micro_batches int - | Micro-batches per pipeline step.
sequence_parallelism str - | Sequence parallelism: true/false.
recompute_activations str - | Recompute activations: true/false.
use_distributed_optimizer str - | Shard the optimizer state: true/false.
gradient_clipping float 1.0 | Clip the gradient norm at this value.
recompute_granularity str - | full or selective recomputation.
recompute_method str - | uniform or block recomputation.
recompute_num_layers int - | Layers per recomputation unit.
attention_backend str - | Attention implementation.
expert_model_parallel_size int - | Expert-parallel degree (MoE).
context_parallel_size int - | Context-parallel degree.
attention_dropout float - | Attention dropout.
hidden_dropout float - | Hidden-layer dropout.
attention_softmax_in_fp32 str - | Softmax in float32: true/false.
expert_tensor_parallel_size int - | Tensor-parallel degree inside experts.
calculate_per_token_loss str - | Average the loss per token: true/false.
use_rotary_position_embeddings str - | Rotary position embeddings: true/false.
""",
)
_FP8 = (
    (("--fp8_backend",), _value(str, "FP8 engine: TransformerEngine, MS-AMP or torchao.", choices=["ao", "te", "msamp"])),
    (("--fp8_use_autocast_during_eval",), _flag("Keep FP8 autocast in evaluation.", default=False)),
    (("--fp8_margin",), _value(int, "TE: margin of the scaling factor.", 0)),
    (("--fp8_interval",), _value(int, "TE: steps between scaling-factor updates.", 1)),
    (("--fp8_format",), _value(str, "TE: FP8 format.", "HYBRID", choices=["HYBRID", "E4M3", "E5M2"])),
    (("--fp8_amax_history_len",), _value(int, "TE: length of the amax history.", 1024)),
    (("--fp8_amax_compute_algo",), _value(str, "TE: amax from the history.", "most_recent", choices=["max", "most_recent"])),
    (("--fp8_override_linear_precision",), _value(bool_triple, "TE: higher precision for fprop,dgrad,wgrad (3 bools).", (False, False, False))),
    (("--fp8_opt_level",), _value(str, "MS-AMP optimisation level.", "O2", choices=["O1", "O2"])),
    (("--fp8_enable_fsdp_float8_all_gather",), _value(str_to_bool, "torchao: FP8 all-gather under FSDP2.", "true")),
    (("--fp8_pad_inner_dim",), _value(str_to_bool, "torchao: pad inner dimensions to multiples of 16.", "true")),
)  # fmt: skip
_AWS = (
    (("--aws_access_key_id",), _value(str, "AWS access key id for a SageMaker launch.")),
    (("--aws_secret_access_key",), _value(str, "AWS secret access key for a SageMaker launch.")),
)
_MPI = ((("--mpirun_hostfile",), _value(str, "mpirun hostfile for a multi-CPU launch over machines.")),)
_PARALLELISM = (
    (("--parallelism_config_dp_replicate_size",), _value(int, "Replicated data-parallel degree.", 1)),
    (("--parallelism_config_dp_shard_size",), _value(int, "Sharded data-parallel degree.", 1)),
    (("--parallelism_config_tp_size",), _value(int, "Tensor-parallel degree.", 1)),
    (("--parallelism_config_cp_size",), _value(int, "Context-parallel degree.", 1)),
    (("--parallelism_config_cp_backend",), _value(str, "Context-parallel engine.", "torch", choices=["torch"])),
    (("--parallelism_config_cp_comm_strategy",), _value(str, "Context-parallel exchange.", "allgather")),
    (("--parallelism_config_sp_size",), _value(int, "Sequence-parallel degree.", 1)),
    (("--parallelism_config_sp_backend",), _value(str, "Sequence-parallel engine.", "deepspeed", choices=["deepspeed"])),
    (("--parallelism_config_sp_seq_length",), _value(str, "Sequence length for sequence parallelism.")),
    (("--parallelism_config_sp_seq_length_is_variable",), _value(bool, "Sequences vary in length.", True)),
    (("--parallelism_config_sp_attn_implementation",), _value(str, "Attention kernel under sequence parallelism.", "sdpa")),
)  # fmt: skip

# (help group title, its description, its options); ``None``: the parser's own options group.
LAUNCH_OPTION_GROUPS = (
    (None, None, _GENERAL),
    ("Hardware Selection Arguments", "What to run on.", _HARDWARE),
    (
        "Resource Selection Arguments",
        "How many processes, threads, which precision and compiler.",
        _RESOURCES,
    ),
    ("Training Paradigm Arguments", "Which engine trains the model.", _PARADIGMS),
    ("Distributed GPUs", "Several processes or machines (torchrun's options).", _DISTRIBUTED),
    ("TPU", "TPU hosts and pods (torch_xla).", _TPU),
    ("DeepSpeed Arguments", "With --use_deepspeed.", _DEEPSPEED),
    ("FSDP Arguments", "With --use_fsdp.", _FSDP),
    ("Megatron-LM Arguments", "With --use_megatron_lm.", _MEGATRON),
    ("FP8 Arguments", "With --mixed_precision fp8.", _FP8),
    ("AWS Arguments", "For a SageMaker launch.", _AWS),
    ("MPI Arguments", "Multi-CPU launches over machines.", _MPI),
    ("ParallelismConfig Arguments", "With --use_parallelism_config.", _PARALLELISM),
)


def add_launch_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Return ``parser`` with every ``accelerate launch`` option and the two positional arguments added."""
    for title, description, rows in LAUNCH_OPTION_GROUPS:
        target = parser if title is None else parser.add_argument_group(title, description)
        for flags, settings in rows:
            target.add_argument(*_with_dashed_twins(flags), **settings)
    parser.add_argument("training_script", type=str, help="The script (or module, or executable) to run.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="The script's own arguments.")
    return parser
