"""What ``accelerate launch`` does with its namespace before it launches: ``_validate_launch_command``.

As in Accelerate 1.15, the options left out on the command line are filled from the config file (its
fields, its nested ``fsdp_config``/``dynamo_config``/... sections, and the paradigm flag of its
distributed type), 1.15's defaults are used where there is no config file (with 1.15's warning naming
them), and the paradigm flags given together are refused. tests/test_launch_validation.py holds the
namespaces to the ones 1.15 produced for the same command lines and config files
(tests/data/launch_validation_1_15.json, scripts/record_launch_validation.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
from typing import Any

from ..utils.enums import DistributedType, check_mixed_precision
from .config.config_args import SageMakerConfig, default_config_file, load_config_from_file
from .launch_options import add_launch_options

__all__ = ["_validate_launch_command", "clean_option"]

logger = logging.getLogger(__name__)

# A config file's nested sections, and the prefix their keys get as launch options.
_CONFIG_SECTIONS = {"fsdp_config": "", "deepspeed_config": "", "megatron_lm_config": "", "fp8_config": "fp8_",
                    "dynamo_config": "", "mpirun_config": "", "parallelism_config": "parallelism_config_"}  # fmt: skip
_PARADIGM_OF = {DistributedType.DEEPSPEED: "use_deepspeed", DistributedType.FSDP: "use_fsdp",
                DistributedType.MEGATRON_LM: "use_megatron_lm", DistributedType.XLA: "tpu",
                DistributedType.MULTI_GPU: "multi_gpu"}  # fmt: skip
# The flags of which a command line may give one (1.15 names them in this order).
_EXCLUSIVE = ("cpu", "multi_gpu", "tpu", "use_deepspeed", "use_fsdp")
# The options that get a default, with a warning naming them, when neither the command line nor a
# config file gives them.
_WARNED_DEFAULTS = {"num_processes": 0, "num_machines": 1, "mixed_precision": "no", "dynamo_backend": "no"}


def clean_option(option):
    """Return the destination name of a long option (``"--num-processes"`` -> ``"num_processes"``), else None."""
    if "-" in option[:2]:
        option = option[2:] if option.startswith("--") else None
    return option.replace("-", "_") if option and option[:1] != "-" and len(option) > 1 else None


@functools.cache
def _option_defaults() -> dict[str, object]:
    """Return each launch option's destination and its value when not given (the positionals: None)."""
    parser = add_launch_options(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    parsed = vars(parser.parse_args(["script"]))  # what argparse makes of each default (types applied)
    return {**parsed, "training_script": None, "training_script_args": None}


def _top_level_values(config) -> dict[str, object]:
    """Return a loaded config's own fields (unset ones too, as 1.15 carries them), not its sections."""
    skip = ("compute_environment", "distributed_type", *_CONFIG_SECTIONS)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in skip}
    values["gpu_ids"] = values.get("gpu_ids") or "all"
    return values


def _section_values(config) -> dict[str, object]:
    """Return the keys of a loaded config's nested sections, spelled as launch options."""
    values = {}
    for section, prefix in _CONFIG_SECTIONS.items():
        for key, value in (getattr(config, section, None) or {}).items():
            values[key if key.startswith(prefix) else prefix + key] = value
    return values


def _fill_from_config(args: argparse.Namespace, config, given: set[str]) -> None:
    """Set on ``args`` what ``config`` gives for the options the command line left out.

    A top-level field fills an option still ``None``; a section's key fills an option not ``given``;
    the config's paradigm flag is set unless the command line named a paradigm. A key that is no
    launch option (``tpu_name``, ``commands``...) is carried onto ``args`` as is.
    """
    for name, value in _top_level_values(config).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name, value in _section_values(config).items():
        if name not in given:
            setattr(args, name, value)
    if config.distributed_type == DistributedType.XLA and "tpu_use_cluster" not in given:
        args.tpu_use_cluster = bool(getattr(config, "tpu_use_cluster", False))
    if args.num_processes == -1:  # the config file's "not set", and not given on the command line
        raise ValueError(
            "You need to manually pass in `--num_processes` using this config yaml. "
            f"({getattr(args, 'config_file', None) or default_config_file} sets no num_processes.)"
        )
    flag = _PARADIGM_OF.get(config.distributed_type)
    if flag and not any(getattr(args, name, False) for name in (*_EXCLUSIVE, "use_megatron_lm")):
        setattr(args, flag, True)


def _fill_defaults(args: argparse.Namespace, *, warn: bool) -> None:
    """Set 1.15's defaults for the options nothing gave; without a config file (``warn``), log one
    warning that names them."""
    used = []
    for name, value in _WARNED_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            used.append(f"\t`--{name}` was set to a value of `{value!r}`")
    if used and warn:
        logger.warning(
            "The following values were not passed to `accelerate launch` and had defaults used instead:\n"
            + "\n".join(used)
            + "\nTo avoid this warning pass in values for each of the problematic parameters or run "
            "`accelerate config`."
        )


def _validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, bool]:
    """Return ``(args, config, mixed_precision_from_config)``: ``args`` filled and checked as 1.15 does.

    ``config`` is the loaded config file (None without one); the flag says the precision came from it.
    ``args.nondefault`` names the options the command line gave. Two paradigm flags given together
    (``--cpu``, ``--multi_gpu``, ``--tpu``, ``--use_deepspeed``, ``--use_fsdp``) raise ``ValueError``.
    """
    if sum(bool(getattr(args, name, False)) for name in _EXCLUSIVE) > 1:
        raise ValueError(
            "You can only use one of `--cpu`, `--multi_gpu`, `--tpu`, `--use_deepspeed`, `--use_fsdp` at a time."
        )
    defaults = _option_defaults()
    given = {name for name, value in vars(args).items() if name in defaults and value != defaults[name]}
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    config = load_config_from_file(path) if path is not None else None
    if isinstance(config, SageMakerConfig):
        # a SageMaker job takes the command line as it is (its launcher reads the config itself)
        return args, config, False
    args.nondefault = given
    if config is not None:
        _fill_from_config(args, config, given)
    args.use_cpu = bool(args.cpu or getattr(config, "use_cpu", False))
    args.debug = bool(args.debug)
    if args.debug:
        logger.debug("Running script in debug mode, expect distributed operations to be slightly slower.")
    _fill_defaults(args, warn=config is None)
    args.mixed_precision = check_mixed_precision(args.mixed_precision, "--mixed_precision")
    if args.num_cpu_threads_per_process is None:
        local = max(1, args.num_processes // max(1, args.num_machines))
        args.num_cpu_threads_per_process = max(1, (os.cpu_count() or 1) // local) if args.use_cpu else 1
    return args, config, config is not None and "mixed_precision" not in given
