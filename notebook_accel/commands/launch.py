"""``accelerate launch``: run a training script in one process, or in several through torchrun.

The options are the common ones of Accelerate's command (processes, machines, precision, CPU, the
rendezvous address, ``-m``); values missing on the command line come from the config file
(``accelerate config default``). One process runs the script in a child Python; more go through
``python -m torch.distributed.run`` (torchrun), whose workers our ``PartialState`` (or Accelerate's)
reads. DeepSpeed, SageMaker and TPU launches check their requirements and name what to install.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

from ..utils.constants import DEEPSPEED_MULTINODE_LAUNCHERS, TORCH_DYNAMO_MODES
from ..utils.enums import MIXED_PRECISION_CHOICES, ComputeEnvironment, DistributedType
from ..utils.environment import (
    check_cuda_p2p_ib_support,
    convert_dict_to_env_variables,
    get_int_from_env,
    patch_environment,
    str_to_bool,
)
from ..utils.imports import (
    is_bf16_available,
    is_deepspeed_available,
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_rich_available,
    is_sagemaker_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xpu_available,
)
from .config.config_args import SageMakerConfig, default_config_file, load_config_from_file
from .launch_env import (
    PrepareForLaunch,
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_sagemager_args_inputs,
    prepare_simple_launcher_cmd_env,
    prepare_tpu,
)
from .utils import CustomArgumentParser

__all__ = [
    "DEEPSPEED_MULTINODE_LAUNCHERS",
    "TORCH_DYNAMO_MODES",
    "ComputeEnvironment",
    "CustomArgumentParser",
    "CustomHelpFormatter",
    "DistributedType",
    "PrepareForLaunch",
    "SageMakerConfig",
    "check_cuda_p2p_ib_support",
    "clean_option",
    "convert_dict_to_env_variables",
    "deepspeed_launcher",
    "default_config_file",
    "get_int_from_env",
    "is_bf16_available",
    "is_deepspeed_available",
    "is_hpu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_rich_available",
    "is_sagemaker_available",
    "is_sdaa_available",
    "is_torch_xla_available",
    "is_xpu_available",
    "launch_command",
    "launch_command_parser",
    "load_config_from_file",
    "main",
    "multi_gpu_launcher",
    "options_to_group",
    "patch_environment",
    "prepare_deepspeed_cmd_env",
    "prepare_multi_gpu_env",
    "prepare_sagemager_args_inputs",
    "prepare_simple_launcher_cmd_env",
    "prepare_tpu",
    "sagemaker_launcher",
    "simple_launcher",
    "str_to_bool",
    "tpu_launcher",
    "tpu_pod_launcher",
]

logger = logging.getLogger(__name__)

# The flag that opens each option group in the help text.
options_to_group = {
    "multi_gpu": "Distributed GPUs",
    "tpu": "TPU",
    "use_deepspeed": "DeepSpeed Arguments",
    "use_fsdp": "FSDP Arguments",
    "use_megatron_lm": "Megatron-LM Arguments",
    "fp8_backend": "FP8 Arguments",
}

# Config-file keys that fill options left unset on the command line.
_FROM_CONFIG = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                "mixed_precision", "gpu_ids", "rdzv_backend", "same_network", "debug", "use_cpu")  # fmt: skip


def clean_option(option):
    """Return the destination name of a long option (``"--num-processes"`` -> ``"num_processes"``), else None."""
    if "-" in option[:2]:
        option = option[2:] if option.startswith("--") else None
    return option.replace("-", "_") if option and option[:1] != "-" and len(option) > 1 else None


class CustomHelpFormatter(argparse.HelpFormatter):
    """Help formatter that shows each option once, under its underscore spelling, without metavars."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def add_argument(self, action):
        """Return None after adding ``action`` to the help, listing only its ``--under_score`` spellings."""
        if action.option_strings:
            action.option_strings = [
                o for o in action.option_strings if "-" not in o[2:]
            ] or action.option_strings
        action.metavar = " " if action.option_strings else action.metavar
        super().add_argument(action)

    def end_section(self):
        """Return None after closing the current help section (empty sections are dropped)."""
        super().end_section()


def launch_command_parser(subparsers=None):
    """Return the ``launch`` parser (a subparser of ``subparsers`` when given); its ``func`` is ``launch_command``."""
    description = "Launch a python script in a distributed scenario."
    if subparsers is not None:
        parser = subparsers.add_parser("launch", description=description, add_help=True)
    else:
        parser = CustomArgumentParser("Accelerate launch command", description=description, add_help=True,
                                      formatter_class=CustomHelpFormatter)  # fmt: skip
    add = parser.add_argument
    add(
        "--config_file",
        default=None,
        help="Config file to take unset options from (default: the default one).",
    )
    add("--quiet", "-q", action="store_true", help="Print less from torchrun.")
    add("--cpu", action="store_true", help="Run on the CPU even when accelerators are visible.")
    add("--multi_gpu", action="store_true", help="Data parallel over several processes.")
    add("--tpu", action="store_true", help="Launch on TPU (needs torch_xla).")
    add("--use_deepspeed", action="store_true", help="Launch through DeepSpeed (needs deepspeed).")
    add("--use_fsdp", action="store_true", help="Use FullyShardedDataParallel in the Accelerator.")
    add("--use_megatron_lm", action="store_true", help="Use Megatron-LM (needs megatron-core).")
    add(
        "--mixed_precision", choices=list(MIXED_PRECISION_CHOICES), default=None, help="Mixed precision mode."
    )
    add("--num_processes", type=int, default=None, help="Processes to start in all (over all machines).")
    add("--num_machines", type=int, default=None, help="Machines taking part.")
    add("--machine_rank", type=int, default=None, help="This machine's rank (0 is the main one).")
    add("--main_process_ip", type=str, default=None, help="Address of the machine of rank 0.")
    add("--main_process_port", type=int, default=None, help="Rendezvous port on the machine of rank 0.")
    add("--rdzv_backend", type=str, default=None, help="torchrun rendezvous backend: static or c10d.")
    add("--gpu_ids", default=None, help="GPU ids to use on this machine, comma separated.")
    add("--same_network", action="store_true", default=None, help="All machines share a network.")
    add(
        "--debug",
        action="store_true",
        default=None,
        help="Check collectives' shapes (ACCELERATE_DEBUG_MODE).",
    )
    add("--dynamo_backend", type=str, default=None, help="torch.compile backend, or 'no'.")
    add("--dynamo_mode", choices=TORCH_DYNAMO_MODES, default="default", help="torch.compile mode.")
    add("--deepspeed_config_file", default=None, help="DeepSpeed config file (with --use_deepspeed).")
    add("--zero_stage", type=int, default=None, help="DeepSpeed ZeRO stage (with --use_deepspeed).")
    add("--deepspeed_multinode_launcher", choices=DEEPSPEED_MULTINODE_LAUNCHERS, default=None,
        help="DeepSpeed's launcher across machines.")  # fmt: skip
    add("--module", "-m", action="store_true", help="Run the script as a module (python -m).")
    add("--no_python", action="store_true", help="Run the script as an executable, not with Python.")
    add("training_script", type=str, help="The script (or module, or executable) to launch.")
    add("training_script_args", nargs=argparse.REMAINDER, help="Arguments of the training script.")
    parser.set_defaults(func=launch_command)
    return parser


def _fill_from_config(args: argparse.Namespace) -> argparse.Namespace:
    """Return ``args`` with unset options taken from the config file (when one exists), then defaults."""
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    config = load_config_from_file(path).to_dict() if path is not None else {}
    for key in _FROM_CONFIG:
        name = "cpu" if key == "use_cpu" else key
        if getattr(args, name, None) in (None, False) and key in config:
            setattr(args, name, config[key])
    if config.get("distributed_type") == DistributedType.DEEPSPEED:
        args.use_deepspeed = True
    if config.get("distributed_type") == DistributedType.FSDP:
        args.use_fsdp = True
    args.num_processes = 1 if args.num_processes in (None, -1) else args.num_processes
    args.num_machines = args.num_machines or 1
    args.machine_rank = args.machine_rank or 0
    args.mixed_precision = args.mixed_precision or "no"
    args.main_process_ip = args.main_process_ip or "127.0.0.1"
    args.main_process_port = 29500 if args.main_process_port is None else args.main_process_port
    args.rdzv_backend = args.rdzv_backend or "static"
    return args


def _check(args: argparse.Namespace) -> None:
    if args.num_processes < 1 or args.num_machines < 1 or not 0 <= args.machine_rank < args.num_machines:
        raise ValueError(
            f"num_processes={args.num_processes}, num_machines={args.num_machines}, machine_rank={args.machine_rank}: "
            "use at least one process and machine, and a machine rank in [0, num_machines)."
        )
    if args.num_processes % args.num_machines:
        raise ValueError(
            f"num_processes={args.num_processes} is the total over all machines and must divide evenly by "
            f"num_machines={args.num_machines}."
        )


def _accelerate_env(args: argparse.Namespace) -> dict[str, str]:
    """Return the ACCELERATE_* variables the script's Accelerator / PartialState read."""
    env = {"ACCELERATE_MIXED_PRECISION": str(args.mixed_precision)}
    if args.cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    if args.debug:
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if args.use_fsdp:
        env["ACCELERATE_USE_FSDP"] = "true"
    if args.dynamo_backend and str(args.dynamo_backend).lower() != "no":
        env["ACCELERATE_DYNAMO_BACKEND"] = str(args.dynamo_backend).upper()
        env["ACCELERATE_DYNAMO_MODE"] = args.dynamo_mode
    if args.gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = str(args.gpu_ids)
    return env


def _script_cmd(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    head = [sys.executable, "-m"] if args.module else [sys.executable]
    return [*head, args.training_script, *args.training_script_args]


def _run(cmd: list[str], env: dict[str, str]) -> None:
    process = subprocess.run(cmd, env={**os.environ, **env})  # the builders' env already holds os.environ
    if process.returncode != 0:
        raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)


def simple_launcher(args):
    """Return None after running the training script in one child process (CalledProcessError if it fails).

    The command and environment come from ``prepare_simple_launcher_cmd_env`` (what 1.15 builds).
    """
    cmd, env = prepare_simple_launcher_cmd_env(args)
    if args.use_fsdp:
        env["ACCELERATE_USE_FSDP"] = "true"
    _run(cmd, env)


def multi_gpu_launcher(args):
    """Return None after running the script on ``num_processes`` workers through torchrun.

    The environment comes from ``prepare_multi_gpu_env`` (what 1.15 builds for the same options).
    """
    per_machine = args.num_processes // args.num_machines
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={per_machine}",
           f"--nnodes={args.num_machines}", f"--node_rank={args.machine_rank}",
           f"--master_addr={args.main_process_ip}", f"--master_port={args.main_process_port}",
           f"--rdzv_backend={args.rdzv_backend}"]  # fmt: skip
    if args.rdzv_backend == "c10d":
        cmd.append(f"--rdzv_endpoint={args.main_process_ip}:{args.main_process_port}")
    if args.module:
        cmd.append("--module")
    if args.no_python:
        cmd.append("--no-python")
    cmd += [args.training_script, *args.training_script_args]
    env = prepare_multi_gpu_env(argparse.Namespace(**vars(args)))
    if args.cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    if "OMP_NUM_THREADS" not in os.environ and getattr(args, "num_cpu_threads_per_process", None) is None:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_machine))
    _run(cmd, env)


def deepspeed_launcher(args):
    """Return None after launching through DeepSpeed; ImportError naming ``pip install deepspeed`` without it."""
    if args.zero_stage is not None and args.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage {args.zero_stage} is not a ZeRO stage: use 0, 1, 2 or 3.")
    if not is_deepspeed_available():
        raise ImportError(
            "--use_deepspeed launches through DeepSpeed: `pip install deepspeed` (CUDA machines)."
        )
    env = {**_accelerate_env(args), "ACCELERATE_USE_DEEPSPEED": "true"}
    if args.deepspeed_config_file:
        env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(args.deepspeed_config_file)
    if args.zero_stage is not None:
        env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = str(args.zero_stage)
    if args.num_machines > 1 and args.deepspeed_multinode_launcher not in (None, "standard"):
        _run(["deepspeed", f"--num_nodes={args.num_machines}", f"--launcher={args.deepspeed_multinode_launcher}",
              *_script_cmd(args)[1:]], env)  # fmt: skip
        return
    with patch_environment(**env):
        multi_gpu_launcher(args)


def _needs_xla(what: str) -> None:
    if not is_torch_xla_available():
        raise ImportError(
            f"{what} needs torch_xla on a TPU VM: `pip install torch_xla` (Google Cloud TPU / Colab)."
        )


def tpu_launcher(args):
    """Return None after running the script on this TPU host's cores (needs torch_xla)."""
    _needs_xla("--tpu")
    _run(_script_cmd(args), {**_accelerate_env(args), "ACCELERATE_USE_XLA": "true"})


def tpu_pod_launcher(args):
    """Return None after running the script on every host of a TPU pod (needs torch_xla)."""
    _needs_xla("A TPU pod launch")
    _run(["python", "-m", "torch_xla.distributed.xla_dist", "--", *_script_cmd(args)],
         {**_accelerate_env(args), "ACCELERATE_USE_XLA": "true"})  # fmt: skip


def sagemaker_launcher(sagemaker_config, args):
    """Return None after submitting the script as a SageMaker training job (needs the ``sagemaker`` SDK)."""
    if not isinstance(sagemaker_config, SageMakerConfig):
        raise TypeError(f"sagemaker_launcher takes a SageMakerConfig, not {type(sagemaker_config).__name__}.")
    if not is_sagemaker_available():
        raise ImportError(
            "Launching on Amazon SageMaker needs its SDK: `pip install sagemaker`, and AWS credentials."
        )
    from sagemaker.huggingface import HuggingFace

    estimator = HuggingFace(
        entry_point=args.training_script, source_dir=".", role=sagemaker_config.iam_role_name,
        instance_count=sagemaker_config.num_machines, instance_type=sagemaker_config.ec2_instance_type,
        transformers_version=sagemaker_config.transformers_version, pytorch_version=sagemaker_config.pytorch_version,
        py_version=sagemaker_config.py_version, base_job_name=sagemaker_config.base_job_name,
        environment=_accelerate_env(args),
    )  # fmt: skip
    estimator.fit()


def launch_command(args):
    """Return None after launching ``args.training_script`` with the launcher its options call for."""
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    config = load_config_from_file(path) if path is not None else None
    if isinstance(config, SageMakerConfig):
        sagemaker_launcher(config, args)
        return
    args = _fill_from_config(args)
    _check(args)
    if args.use_deepspeed:
        deepspeed_launcher(args)
    elif args.tpu:
        (tpu_pod_launcher if args.num_machines > 1 else tpu_launcher)(args)
    elif args.num_processes > 1 or args.num_machines > 1 or args.multi_gpu or args.use_fsdp:
        multi_gpu_launcher(args)
    else:
        simple_launcher(args)


def main():
    """Return None after parsing ``sys.argv`` as ``accelerate launch`` and launching."""
    parser = launch_command_parser()
    args = parser.parse_args()
    launch_command(args)
