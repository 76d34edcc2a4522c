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
from ..utils.enums import ComputeEnvironment, DistributedType
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
from .launch_options import add_launch_options
from .launch_validate import _validate_launch_command, clean_option
from .utils import CustomArgumentParser

__all__ = [
    "DEEPSPEED_MULTINODE_LAUNCHERS",
    "_validate_launch_command",
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
    """Return the ``launch`` parser (a subparser of ``subparsers`` when given); its ``func`` is ``launch_command``.

    Every option of 1.15's ``accelerate launch`` in its help group (``launch_options``).
    """
    description = (
        "Launch a python script in a distributed scenario. Each option is listed once, and may be written "
        "with dashes or with underscores (`--num-processes 2` is `--num_processes 2`)."
    )
    if subparsers is not None:
        parser = subparsers.add_parser("launch", description=description, add_help=True,
                                       formatter_class=CustomHelpFormatter, allow_abbrev=False)  # fmt: skip
    else:
        parser = CustomArgumentParser("Accelerate launch command", description=description, add_help=True,
                                      formatter_class=CustomHelpFormatter, allow_abbrev=False)  # fmt: skip
    add_launch_options(parser)
    parser.set_defaults(func=launch_command)
    return parser


def _check(args: argparse.Namespace) -> None:
    """Raise ValueError for counts no launcher can run (checks of ours, after 1.15's validation)."""
    rank = args.machine_rank or 0
    if args.num_processes < 0 or args.num_machines < 1 or not 0 <= rank < args.num_machines:
        raise ValueError(
            f"num_processes={args.num_processes}, num_machines={args.num_machines}, machine_rank={rank}: "
            "use at least one machine, and a machine rank in [0, num_machines)."
        )
    if args.num_processes % args.num_machines:
        raise ValueError(
            f"num_processes={args.num_processes} is the total over all machines and must divide evenly by "
            f"num_machines={args.num_machines}."
        )


def _run(cmd: list[str], env: dict[str, str]) -> None:
    process = subprocess.run(cmd, env=env)  # the builders' env holds os.environ and the launch variables
    if process.returncode != 0:
        raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)


def simple_launcher(args):
    """Return None after running the training script in one child process (CalledProcessError if it fails).

    The command and environment come from ``prepare_simple_launcher_cmd_env`` (what 1.15 builds).
    """
    cmd, env = prepare_simple_launcher_cmd_env(args)
    _run(cmd, env)


def _torchrun_cmd(args: argparse.Namespace) -> list[str]:
    """Return ``python -m torch.distributed.run`` with the fields the builders set on ``args``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc_per_node}"]
    if getattr(args, "nnodes", None):
        cmd += [f"--nnodes={args.nnodes}", f"--node_rank={args.node_rank}", f"--rdzv_endpoint={args.rdzv_endpoint}",
                f"--rdzv_backend={args.rdzv_backend}"]  # fmt: skip
    elif getattr(args, "standalone", False):
        cmd.append("--standalone")
    else:
        cmd += [f"--master_addr={args.main_process_ip or '127.0.0.1'}", f"--master_port={args.master_port}"]
    cmd += [f"--max_restarts={args.max_restarts}", f"--monitor_interval={args.monitor_interval}",
            f"--role={args.role}", f"--tee={args.tee}"]  # fmt: skip
    if args.rdzv_conf:
        cmd.append(f"--rdzv_conf={args.rdzv_conf}")
    if args.log_dir:
        cmd.append(f"--log_dir={args.log_dir}")
    if args.module:
        cmd.append("--module")
    if args.no_python:
        cmd.append("--no-python")
    return [*cmd, args.training_script, *args.training_script_args]


def multi_gpu_launcher(args):
    """Return None after running the script on ``num_processes`` workers through torchrun.

    The environment and torchrun's fields come from ``prepare_multi_gpu_env`` (what 1.15 builds).
    """
    env = prepare_multi_gpu_env(args)  # with --use_megatron_lm, the script's Accelerator needs megatron-core
    if args.use_cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    _run(_torchrun_cmd(args), env)


def deepspeed_launcher(args):
    """Return None after launching through DeepSpeed; ImportError naming ``pip install deepspeed`` without it."""
    if args.zero_stage is not None and args.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage {args.zero_stage} is not a ZeRO stage: use 0, 1, 2 or 3.")
    cmd, env = prepare_deepspeed_cmd_env(args)
    if not is_deepspeed_available():
        raise ImportError(
            "--use_deepspeed launches through DeepSpeed: `pip install deepspeed` (CUDA machines)."
        )
    _run(cmd if cmd is not None else _torchrun_cmd(args), env)


def _needs_xla(what: str) -> None:
    if not is_torch_xla_available():
        raise ImportError(
            f"{what} needs torch_xla on a TPU VM: `pip install torch_xla` (Google Cloud TPU / Colab)."
        )


def tpu_launcher(args):
    """Return None after running the script on this TPU host's cores (needs torch_xla)."""
    args, env = prepare_tpu(args, os.environ.copy())
    _needs_xla("--tpu")
    cmd, _ = prepare_simple_launcher_cmd_env(args)
    _run(cmd, {**env, "ACCELERATE_USE_XLA": "true"})


def tpu_pod_launcher(args):
    """Return None after running the script on every host of a TPU pod (needs torch_xla)."""
    args, env = prepare_tpu(args, os.environ.copy(), pod=True)
    _needs_xla("A TPU pod launch")
    cmd = [sys.executable, "-m", "torch_xla.distributed.xla_dist", f"--tpu={args.tpu_name}"]
    _run([*cmd, "--", *prepare_simple_launcher_cmd_env(args)[0]], {**env, "ACCELERATE_USE_XLA": "true"})


def sagemaker_launcher(sagemaker_config, args):
    """Return None after submitting the script as a SageMaker training job (needs the ``sagemaker`` SDK)."""
    if not isinstance(sagemaker_config, SageMakerConfig):
        raise TypeError(f"sagemaker_launcher takes a SageMakerConfig, not {type(sagemaker_config).__name__}.")
    kwargs, inputs = prepare_sagemager_args_inputs(sagemaker_config, args)
    if not is_sagemaker_available():
        raise ImportError(
            "Launching on Amazon SageMaker needs its SDK: `pip install sagemaker`, and AWS credentials."
        )
    from sagemaker.huggingface import HuggingFace

    HuggingFace(**kwargs).fit(inputs=inputs)


def launch_command(args):
    """Return None after launching ``args.training_script`` with the launcher its options call for.

    The namespace is filled and checked first (``_validate_launch_command``, as 1.15 does).
    """
    args, config, _ = _validate_launch_command(args)
    if isinstance(config, SageMakerConfig):
        sagemaker_launcher(config, args)
        return
    _check(args)
    if args.use_deepspeed:
        if not hasattr(args, "deepspeed_fields_from_accelerate_config"):
            args.deepspeed_fields_from_accelerate_config = sorted(
                getattr(config, "deepspeed_config", None) or {}
            )
        deepspeed_launcher(args)
    elif args.tpu:
        (tpu_pod_launcher if args.tpu_use_cluster else tpu_launcher)(args)
    elif args.mpirun_hostfile is not None and not (args.multi_gpu or args.use_fsdp or args.use_megatron_lm):
        simple_launcher(args)  # mpirun starts every rank (prepare_simple_launcher_cmd_env), as in 1.15
    elif (
        args.num_processes > 1
        or args.num_machines > 1
        or args.multi_gpu
        or args.use_fsdp
        or args.use_megatron_lm
    ):
        multi_gpu_launcher(args)
    else:
        simple_launcher(args)


def main():
    """Return None after parsing ``sys.argv`` as ``accelerate launch`` and launching."""
    parser = launch_command_parser()
    args = parser.parse_args()
    launch_command(args)
