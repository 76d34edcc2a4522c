"""The builders of ``accelerate launch``: from the launch command's namespace to the child's command line
and environment, and every other name Accelerate 1.15 serves at ``accelerate.utils.launch``.

``notebook_accel.utils.launch`` keeps ``PrepareForLaunch`` (the notebook launcher's piece) and serves the
names of this module's ``__all__`` there at first use (``_lazy.forward``), so ``from accelerate.utils.launch
import prepare_multi_gpu_env`` works while ``utils`` holds no command-line code. tests/test_cli_commands.py
holds the builders to what 1.15 builds for the same namespace.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..utils.constants import DEEPSPEED_MULTINODE_LAUNCHERS
from ..utils.enums import DistributedType, DynamoBackend, PrecisionType, SageMakerDistributedType
from ..utils.environment import str_to_bool
from ..utils.imports import (
    is_fp8_available,
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xpu_available,
)
from ..utils.launch import PrepareForLaunch, mpi_launch_prefix
from ..utils.network import get_free_port, is_port_in_use
from ..utils.other import merge_dicts
from ..utils.versions import compare_versions
from .config.config_args import SageMakerConfig

# ``_convert_nargs_to_dict`` is private in 1.15 too, but its launch code imports it from
# ``accelerate.utils.launch``: listed so that path serves it.
__all__ = [
    "_convert_nargs_to_dict",
    "env_var_path_add",
    "prepare_deepspeed_cmd_env",
    "prepare_extend_env_parallelism_config",
    "prepare_multi_gpu_env",
    "prepare_sagemager_args_inputs",
    "prepare_simple_launcher_cmd_env",
    "prepare_tpu",
    "setup_fp8_env",
]
# Accelerate 1.15 serves these names at ``accelerate.utils.launch`` too (defined elsewhere).
__all__ += [
    "DEEPSPEED_MULTINODE_LAUNCHERS",
    "DistributedType",
    "DynamoBackend",
    "PrecisionType",
    "PrepareForLaunch",
    "SageMakerConfig",
    "SageMakerDistributedType",
    "compare_versions",
    "get_free_port",
    "is_fp8_available",
    "is_hpu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_port_in_use",
    "is_sdaa_available",
    "is_torch_xla_available",
    "is_xpu_available",
    "merge_dicts",
    "str_to_bool",
]


def env_var_path_add(env_var_name: str, path_to_add: str) -> str:
    """Return the value of path-list variable ``env_var_name`` with ``path_to_add`` appended (``os.pathsep``).

    The environment is not changed: the caller sets the returned value.
    """
    paths = [p for p in os.environ.get(env_var_name, "").split(os.pathsep) if p]
    paths.append(str(path_to_add))
    return os.pathsep.join(paths)


def setup_fp8_env(args: argparse.Namespace, current_env: dict[str, str]) -> dict[str, str]:
    """Return ``current_env`` with an ``ACCELERATE_FP8_*`` variable for every ``fp8_*`` option set in ``args``.

    ``fp8_override_linear_precision`` (three bools) becomes ``ACCELERATE_FP8_OVERRIDE_FPROP``,
    ``_DGRAD`` and ``_WGRAD``; the FP8 recipes read these variables.
    """
    for name, value in vars(args).items():
        if not name.startswith("fp8_") or value is None:
            continue
        if name == "fp8_override_linear_precision":
            for gemm, flag in zip(("FPROP", "DGRAD", "WGRAD"), value):
                current_env[f"ACCELERATE_FP8_OVERRIDE_{gemm}"] = str(flag)
        else:
            current_env[f"ACCELERATE_{name.upper()}"] = str(value)
    return current_env


def _nargs_value(text: str) -> Any:
    """Return ``text`` as SageMaker's hyperparameter value, converted as 1.15 converts it.

    Exactly ``"True"`` / ``"False"`` become bools (``"true"`` stays a string); a number becomes a
    ``float``, and an ``int`` when it has no fraction (``"3"``, ``"1e3"``, ``"7."``: read through the
    float, so past 2**53 the int is the float's); anything else stays the string.
    """
    if text in ("True", "False"):
        return text == "True"
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() else number


def _convert_nargs_to_dict(nargs: list[str]) -> dict[str, Any]:
    """Return the ``--key value`` pairs of ``nargs`` (a script's arguments) as a dict, as 1.15 does.

    Every item starting with ``-`` is a key (dashes inside become underscores) and needs the next item
    as its value, converted by ``_nargs_value`` (bools, ints, floats as 1.15). Raises ``ValueError`` for
    a key without a value (a ``--flag``, ``--key=value``: SageMaker's hyperparameters need explicit
    values, 1.15's message), a value without a key, and a key given twice.
    """
    out: dict[str, Any] = {}
    items = list(nargs)
    for index in range(0, len(items), 2):
        key, value = items[index], items[index + 1] if index + 1 < len(items) else None
        if not key.startswith("-"):
            raise ValueError(
                f"Script argument {key!r} has no `--name` before it: pass the script's arguments as "
                f"`--name value` pairs (e.g. `--name {key}`)."
            )
        if value is None or value.startswith("-"):
            raise ValueError(
                "SageMaker doesn’t support argparse actions for `store_true` or `store_false`. Please define "
                f"explicit types: give {key!r} a value of its own (`{key.split('=')[0]} <value>`)."
            )
        name = key.lstrip("-").replace("-", "_")
        if name in out:
            raise ValueError(f"Script argument {key!r} is given twice: keep one `{key} <value>`.")
        out[name] = _nargs_value(value)
    return out


def _opt(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _common_env(args: argparse.Namespace, *, dynamo: bool = True) -> dict[str, str]:
    """Return the variables every launch sets: debug, visible devices, precision (FP8 checked), compile."""
    env: dict[str, str] = {}
    if _opt(args, "debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    gpu_ids = _opt(args, "gpu_ids")
    if gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    precision = str(_opt(args, "mixed_precision") or "no").lower()
    if precision not in PrecisionType.list():
        raise ValueError(f"--mixed_precision {precision!r} is unknown: choose one of {PrecisionType.list()}.")
    if precision == "fp8":
        if not is_fp8_available():
            raise RuntimeError(
                "FP8 is not available on this machine. Please ensure that either Transformer Engine, MSAMP or "
                "torchao is installed, or run with --mixed_precision bf16 / fp16 / no."
            )
        setup_fp8_env(args, env)
    env["ACCELERATE_MIXED_PRECISION"] = precision
    if dynamo:
        env["ACCELERATE_DYNAMO_BACKEND"] = str(_opt(args, "dynamo_backend") or "no").upper()
        env["ACCELERATE_DYNAMO_MODE"] = str(_opt(args, "dynamo_mode") or "default")
        for flag in ("fullgraph", "dynamic", "regional_compilation"):
            env[f"ACCELERATE_DYNAMO_USE_{flag.upper()}"] = str(bool(_opt(args, f"dynamo_use_{flag}")))
        threads = _opt(args, "num_cpu_threads_per_process")
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
    return env


def _prefixed_env(args: argparse.Namespace, option_prefix: str, env_prefix: str) -> dict[str, str]:
    """Return ``env_prefix + NAME = str(value)`` for every set option ``option_prefix + name``."""
    return {
        env_prefix + name[len(option_prefix) :].upper(): str(value)
        for name, value in vars(args).items()
        if name.startswith(option_prefix) and value is not None
    }


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Return ``(cmd, env)`` for running the script in one child process (the ``simple_launcher``).

    ``cmd`` is ``[python, (-m,) script, *script_args]`` (just the script with ``--no_python``); ``env``
    is a copy of ``os.environ`` with the launch variables added. More than one process (this process
    is one of a group another launcher forms) also sets ``MASTER_ADDR``/``MASTER_PORT``. With
    ``--mpirun_hostfile``, ``cmd`` starts with the MPI launcher that runs every rank (``mpi_launch_prefix``).
    """
    script, script_args = args.training_script, list(_opt(args, "training_script_args") or [])
    if _opt(args, "no_python") and _opt(args, "module"):
        raise ValueError("--module and --no_python cannot be used together: pick one way to run the script.")
    if _opt(args, "no_python"):
        cmd = [script, *script_args]
    else:
        cmd = [sys.executable, *(["-m"] if _opt(args, "module") else []), script, *script_args]
    if _opt(args, "mpirun_hostfile") is not None:
        processes = _opt(args, "num_processes") or 1
        cmd = [*mpi_launch_prefix(args.mpirun_hostfile, processes, _opt(args, "num_machines") or 1), *cmd]
    env = os.environ.copy()
    use_cpu = bool(_opt(args, "cpu") or _opt(args, "use_cpu"))
    env["ACCELERATE_USE_CPU"] = str(use_cpu)
    if (_opt(args, "num_machines") or 1) > 1 or (_opt(args, "num_processes") or 1) > 1:
        env["MASTER_ADDR"] = str(_opt(args, "main_process_ip") or "127.0.0.1")
        env["MASTER_PORT"] = str(29500 if _opt(args, "main_process_port") is None else args.main_process_port)
    if use_cpu:
        env["KMP_AFFINITY"] = "granularity=fine,compact,1,0"
        env["KMP_BLOCKTIME"] = str(1)
    env.update(_common_env(args))
    return cmd, env


def _torchrun_fields(args: argparse.Namespace) -> None:
    """Set the attributes ``torch.distributed.run`` reads from the launch namespace."""
    machines = _opt(args, "num_machines") or 1
    processes = _opt(args, "num_processes") or 0
    if machines > 1:
        if _opt(args, "machine_rank") is None:
            raise ValueError("--num_machines > 1 needs --machine_rank (0 on the main machine).")
        args.nproc_per_node = str(processes // machines)
        args.nnodes = str(machines)
        args.node_rank = int(args.machine_rank)
        args.rdzv_endpoint = f"{_opt(args, 'main_process_ip')}:{_opt(args, 'main_process_port')}"
        return
    args.nproc_per_node = str(processes)
    if _opt(args, "main_process_port") is None:
        args.main_process_port = 29500
    elif int(args.main_process_port) == 0:
        # port 0 asks for any free one (1.15's automatic selection); torchrun itself would refuse 0
        args.main_process_port = get_free_port()
    if is_port_in_use(int(args.main_process_port)):
        # taken (another run on this machine): torchrun's standalone rendezvous picks a free port
        args.standalone = True
    args.master_port = str(args.main_process_port)


def prepare_extend_env_parallelism_config(
    args: argparse.Namespace, current_env: dict[str, str]
) -> dict[str, str]:
    """Return ``current_env`` with the ``PARALLELISM_CONFIG_*`` variables ``ParallelismConfig`` reads.

    Only with ``--use_parallelism_config``; the context-parallel strategy is added when ``cp_size > 1``
    and the sequence-parallel details when ``sp_size > 1``.
    """
    if not _opt(args, "use_parallelism_config"):
        return current_env
    current_env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    names = [
        "dp_replicate_size",
        "dp_shard_size",
        "tp_size",
        "cp_size",
        "cp_backend",
        "sp_size",
        "sp_backend",
    ]
    if int(_opt(args, "parallelism_config_cp_size") or 1) > 1:
        names.append("cp_comm_strategy")
    if int(_opt(args, "parallelism_config_sp_size") or 1) > 1:
        names += ["sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"]
    for name in names:
        current_env[f"PARALLELISM_CONFIG_{name.upper()}"] = str(_opt(args, f"parallelism_config_{name}"))
    return current_env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """Return the environment for a torchrun launch, after setting torchrun's fields on ``args``.

    ``args`` gets ``nproc_per_node`` (and ``nnodes``/``node_rank``/``rdzv_endpoint`` over several
    machines, or ``master_port`` and, without a port, ``standalone``); the environment carries the
    precision, compile, FSDP (``FSDP_*``), Megatron-LM (``MEGATRON_LM_*``) and parallelism settings.
    """
    _torchrun_fields(args)
    env = os.environ.copy()
    env.update(_common_env(args))
    if _opt(args, "use_fsdp"):
        env["ACCELERATE_USE_FSDP"] = "true"
        env.update(_prefixed_env(args, "fsdp_", "FSDP_"))
    if _opt(args, "use_megatron_lm"):
        env["ACCELERATE_USE_MEGATRON_LM"] = "true"
        env.update(_prefixed_env(args, "megatron_lm_", "MEGATRON_LM_"))
    return prepare_extend_env_parallelism_config(args, env)


_DEEPSPEED_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}


def _deepspeed_cmd(args: argparse.Namespace) -> list[str]:
    """Return the ``deepspeed`` runner's command for a launch over several machines."""
    per_machine = int(args.num_processes) // int(args.num_machines)
    cmd = ["deepspeed", "--hostfile", str(_opt(args, "deepspeed_hostfile")), "--no_local_rank",
           "--launcher", str(args.deepspeed_multinode_launcher)]  # fmt: skip
    if _opt(args, "deepspeed_inclusion_filter") is not None:
        cmd += ["--include", str(args.deepspeed_inclusion_filter)]
    elif _opt(args, "deepspeed_exclusion_filter") is not None:
        cmd += ["--exclude", str(args.deepspeed_exclusion_filter)]
    else:
        cmd += ["--num_gpus", str(per_machine)]
    cmd += [
        "--master_addr",
        str(_opt(args, "main_process_ip")),
        "--master_port",
        str(_opt(args, "main_process_port")),
    ]
    if _opt(args, "module") and _opt(args, "no_python"):
        raise ValueError("--module and --no_python cannot be used together: pick one way to run the script.")
    if _opt(args, "module"):
        cmd.append("--module")
    elif _opt(args, "no_python"):
        cmd.append("--no_python")
    return [*cmd, args.training_script, *(_opt(args, "training_script_args") or [])]


def prepare_deepspeed_cmd_env(args: argparse.Namespace) -> tuple[list[str] | None, dict[str, str]]:
    """Return ``(cmd, env)`` for a DeepSpeed launch: ``cmd`` is the ``deepspeed`` runner's command over
    several machines with a multinode launcher other than ``standard``, else ``None`` (torchrun runs it,
    with the fields this sets on ``args``). ``env`` carries ``ACCELERATE_USE_DEEPSPEED`` and the ZeRO
    options given on the command line, and puts the current folder on ``PYTHONPATH``.
    """
    if _opt(args, "deepspeed_multinode_launcher") is None:
        args.deepspeed_multinode_launcher = DEEPSPEED_MULTINODE_LAUNCHERS[0]
    if args.deepspeed_multinode_launcher not in DEEPSPEED_MULTINODE_LAUNCHERS:
        raise ValueError(
            f"--deepspeed_multinode_launcher {args.deepspeed_multinode_launcher!r} is unknown: choose one of "
            f"{DEEPSPEED_MULTINODE_LAUNCHERS}."
        )
    cmd = None
    if (_opt(args, "num_machines") or 1) > 1 and args.deepspeed_multinode_launcher != "standard":
        cmd = _deepspeed_cmd(args)
    else:
        _torchrun_fields(args)
    env = os.environ.copy()
    env.update(_common_env(args, dynamo=False))
    env["PYTHONPATH"] = env_var_path_add("PYTHONPATH", os.path.abspath("."))
    env["ACCELERATE_CONFIG_DS_FIELDS"] = str(
        list(_opt(args, "deepspeed_fields_from_accelerate_config") or [])
    )
    env["ACCELERATE_USE_DEEPSPEED"] = "true"
    for option, variable in _DEEPSPEED_ENV.items():
        if _opt(args, option) is not None:
            env[variable] = str(getattr(args, option))
    return cmd, prepare_extend_env_parallelism_config(args, env)


def prepare_tpu(
    args: argparse.Namespace, current_env: dict[str, str], pod: bool = False
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Return ``(args, current_env)`` ready for a TPU launch: debug mode in the environment, and for a pod
    the fields ``torch_xla``'s pod runner reads (``vm`` as a list, the ``tpu_name``, the positional
    script arguments).

    Args:
        args: The parsed ``launch`` namespace (``debug``, ``tpu_vm``, ``tpu_name``, ``training_script`` ...).
        current_env: The environment the launch will run with; updated in place and returned.
        pod: Prepare a launch over a TPU pod (several VMs) rather than one host.
    """
    if _opt(args, "debug"):
        current_env["ACCELERATE_DEBUG_MODE"] = "true"
    if pod:
        args.vm = list(_opt(args, "tpu_vm") or [])
        args.tpu_name = _opt(args, "tpu_name")
        args.positional = [args.training_script, *(_opt(args, "training_script_args") or [])]
    return args, current_env


def prepare_sagemager_args_inputs(
    sagemaker_config: Any, args: argparse.Namespace
) -> tuple[dict[str, Any], Any]:
    """Return ``(estimator_kwargs, sagemaker_inputs)`` for a SageMaker ``HuggingFace`` estimator.

    The training script must be a ``.py`` file; its ``--key value`` arguments become the estimator's
    hyperparameters; ``sagemaker_inputs_file`` (a tab separated ``name<TAB>s3 uri`` file) gives the
    inputs. The spelling ``sagemager`` is 1.15's public name.
    """
    script = str(args.training_script)
    if not script.endswith(".py"):
        raise ValueError(
            f"SageMaker runs Python files: {script!r} does not end in .py; pass the script file."
        )
    environment = {
        "ACCELERATE_USE_SAGEMAKER": "true",
        "ACCELERATE_MIXED_PRECISION": str(_opt(args, "mixed_precision") or sagemaker_config.mixed_precision),
        "ACCELERATE_DYNAMO_BACKEND": str(_opt(args, "dynamo_backend") or "no").upper(),
        "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE": str(sagemaker_config.distributed_type.value),
    }
    inputs = None
    if getattr(sagemaker_config, "sagemaker_inputs_file", None):
        with open(sagemaker_config.sagemaker_inputs_file, encoding="utf-8") as handle:
            rows = [line.rstrip("\n").split("\t") for line in handle.readlines()[1:] if line.strip()]
        inputs = {row[0]: row[1] for row in rows}
    kwargs = {
        "image_uri": getattr(sagemaker_config, "image_uri", None),
        "entry_point": os.path.basename(script),
        "source_dir": os.path.dirname(script) or ".",
        "role": sagemaker_config.iam_role_name,
        "transformers_version": sagemaker_config.transformers_version,
        "pytorch_version": sagemaker_config.pytorch_version,
        "py_version": sagemaker_config.py_version,
        "base_job_name": sagemaker_config.base_job_name,
        "instance_count": sagemaker_config.num_machines,
        "instance_type": sagemaker_config.ec2_instance_type,
        "debugger_hook_config": False,
        "distribution": None,
        "hyperparameters": _convert_nargs_to_dict(list(_opt(args, "training_script_args") or [])),
        "environment": environment,
    }
    return kwargs, inputs
