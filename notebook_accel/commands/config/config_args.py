"""The ``accelerate config`` file as dataclasses: ``ClusterConfig`` / ``SageMakerConfig`` and ``load_config_from_file``.

A config file is YAML (``default_config.yaml``) or JSON (any ``*.json``); keys are the dataclass
fields. Reading YAML needs PyYAML (transformers depends on it; ``pip install pyyaml`` otherwise).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union

from ...utils.atomic_files import atomic_write
from ...utils.config_file import default_config_file
from ...utils.enums import ComputeEnvironment, DistributedType, PrecisionType, SageMakerDistributedType

__all__ = [
    "SAGEMAKER_PYTHON_VERSION",
    "SAGEMAKER_PYTORCH_VERSION",
    "SAGEMAKER_TRANSFORMERS_VERSION",
    "BaseConfig",
    "ClusterConfig",
    "ComputeEnvironment",
    "DistributedType",
    "SageMakerConfig",
    "SageMakerDistributedType",
    "cache_dir",
    "default_config_file",
    "default_json_config_file",
    "default_yaml_config_file",
    "hf_cache_home",
    "load_config_from_file",
]

hf_cache_home = os.path.expanduser(
    os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
)
cache_dir = os.path.join(hf_cache_home, "accelerate")
default_yaml_config_file = os.path.join(cache_dir, "default_config.yaml")
# Accelerate 1.15 names the JSON default with the same .yaml path (a recorded fact; kept for equality).
default_json_config_file = default_yaml_config_file

SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError as err:
        raise ImportError(
            f"Reading the YAML config file {path} needs PyYAML: `pip install pyyaml`, or use a .json config file."
        ) from err
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return data or {}


@dataclass
class BaseConfig:
    """Fields every config file has: where it runs, how it is distributed, precision, CPU only, debug."""

    compute_environment: ComputeEnvironment
    distributed_type: Union[DistributedType, SageMakerDistributedType]
    mixed_precision: str
    use_cpu: bool
    debug: bool

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as plain values (enums as strings), leaving out unset ones (None, empty dicts)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (isinstance(value, dict) and not value):
                continue
            out[f.name] = value.value if isinstance(value, Enum) else value
        return out

    @staticmethod
    def process_config(config_dict: dict[str, Any]) -> dict[str, Any]:
        """Return ``config_dict`` with legacy keys converted; raise ValueError when ``distributed_type`` is missing."""
        if "distributed_type" not in config_dict:
            raise ValueError(
                "A `distributed_type` must be specified in the config file, e.g. `distributed_type: 'NO'` "
                "(or MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED...); `accelerate config default` writes a complete one."
            )
        if config_dict["distributed_type"] is False:  # YAML 1.1 reads an unquoted NO as false
            config_dict["distributed_type"] = "NO"
        if "compute_environment" not in config_dict:
            config_dict["compute_environment"] = ComputeEnvironment.LOCAL_MACHINE
        if "mixed_precision" not in config_dict:
            fp16 = config_dict.pop("fp16", False)  # files older than mixed_precision had a boolean
            config_dict["mixed_precision"] = "fp16" if fp16 else "no"
        elif config_dict["mixed_precision"] is None or config_dict["mixed_precision"] is False:
            config_dict["mixed_precision"] = "no"
        config_dict.setdefault("use_cpu", False)
        config_dict.setdefault("debug", False)
        backend = config_dict.pop("dynamo_backend", None)
        if backend is not None and str(backend).upper() != "NO":
            config_dict["dynamo_config"] = {"dynamo_backend": str(backend).upper()}
        return config_dict

    @classmethod
    def _from_dict(cls, config_dict: dict[str, Any], path: str):
        config_dict = cls.process_config(dict(config_dict))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config_dict) - known)
        if unknown:
            raise ValueError(
                f"The config file at {path} had unknown keys ({unknown}), please try upgrading your `accelerate` "
                "version or fix (and potentially remove) these keys from your config file."
            )
        return cls(**config_dict)

    @classmethod
    def from_json_file(cls, json_file=None):
        """Return the config read from ``json_file`` (default: ``default_json_config_file``)."""
        path = json_file if json_file is not None else default_json_config_file
        with open(path, encoding="utf-8") as f:
            return cls._from_dict(json.load(f), path)

    @classmethod
    def from_yaml_file(cls, yaml_file=None):
        """Return the config read from ``yaml_file`` (default: ``default_yaml_config_file``)."""
        path = yaml_file if yaml_file is not None else default_yaml_config_file
        return cls._from_dict(_read_yaml(path), path)

    def to_json_file(self, json_file):
        """Write the config as sorted, indented JSON to ``json_file`` (atomically); return None."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        atomic_write(str(json_file), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    def to_yaml_file(self, yaml_file):
        """Write the config as YAML to ``yaml_file`` (atomically; needs PyYAML); return None."""
        try:
            import yaml
        except ImportError as err:
            raise ImportError(f"Writing {yaml_file} as YAML needs PyYAML: `pip install pyyaml`.") from err
        text = yaml.safe_dump(self.to_dict())
        atomic_write(str(yaml_file), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    def __post_init__(self):
        if isinstance(self.compute_environment, str):
            self.compute_environment = ComputeEnvironment(self.compute_environment)
        if isinstance(self.distributed_type, str):
            enum_cls = (
                SageMakerDistributedType
                if self.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER
                else DistributedType
            )
            try:
                self.distributed_type = enum_cls(self.distributed_type)
            except ValueError:
                raise ValueError(
                    f"distributed_type {self.distributed_type!r} is not a {enum_cls.__name__}; "
                    f"choose one of {', '.join(enum_cls.list())}"
                ) from None
        if self.mixed_precision is not None and str(self.mixed_precision).lower() not in PrecisionType:
            raise ValueError(
                f"mixed_precision {self.mixed_precision!r} is not supported; choose one of "
                f"{', '.join(PrecisionType.list())}"
            )


@dataclass
class ClusterConfig(BaseConfig):
    """A config for this machine or a cluster of machines (``compute_environment: LOCAL_MACHINE``)."""

    num_processes: int = -1
    machine_rank: int = 0
    num_machines: int = 1
    gpu_ids: Optional[str] = None
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    rdzv_backend: Optional[str] = "static"
    same_network: Optional[bool] = False
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    fp8_config: dict = None
    deepspeed_config: dict = None
    fsdp_config: dict = None
    parallelism_config: dict = None
    megatron_lm_config: dict = None
    mpirun_config: dict = None
    downcast_bf16: bool = False
    tpu_name: str = None
    tpu_zone: str = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str = None
    commands: list[str] = None
    tpu_vm: list[str] = None
    tpu_env: list[str] = None
    dynamo_config: dict = None

    def __post_init__(self):
        # Engine sections default to empty dicts so callers can read keys from them without checks.
        for name in (
            "fp8_config",
            "deepspeed_config",
            "fsdp_config",
            "parallelism_config",
            "megatron_lm_config",
            "mpirun_config",
            "dynamo_config",
        ):
            if getattr(self, name) is None:
                setattr(self, name, {})
        super().__post_init__()


@dataclass
class SageMakerConfig(BaseConfig):
    """A config for a training job on Amazon SageMaker (``compute_environment: AMAZON_SAGEMAKER``)."""

    ec2_instance_type: str
    iam_role_name: str
    image_uri: Optional[str] = None
    profile: Optional[str] = None
    region: str = "us-east-1"
    num_machines: int = 1
    gpu_ids: str = "all"
    base_job_name: str = f"accelerate-sagemaker-{num_machines}"
    pytorch_version: str = SAGEMAKER_PYTORCH_VERSION
    transformers_version: str = SAGEMAKER_TRANSFORMERS_VERSION
    py_version: str = SAGEMAKER_PYTHON_VERSION
    sagemaker_inputs_file: str = None
    sagemaker_metrics_file: str = None
    additional_args: dict = None
    dynamo_config: dict = None
    enable_cpu_affinity: bool = False


def load_config_from_file(config_file):
    """Return the ``ClusterConfig`` or ``SageMakerConfig`` stored in ``config_file`` (default: the default file).

    JSON when the name ends in ``.json``, YAML otherwise. Raises FileNotFoundError for a missing file,
    ValueError for unknown keys or values.
    """
    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"The passed configuration file `{config_file}` does not exist. Please pass an existing file to "
            "`accelerate launch`, or use the default one created through `accelerate config` and run "
            "`accelerate launch` without the `--config_file` argument."
        )
    path = config_file if config_file is not None else default_config_file
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"No accelerate config file at {path}: write one with `accelerate config default` "
            "(notebook_accel.utils.write_basic_config()) or pass config_file=."
        )
    raw = json.loads(Path(path).read_text(encoding="utf-8")) if path.endswith(".json") else _read_yaml(path)
    sagemaker = raw.get("compute_environment", "LOCAL_MACHINE") == ComputeEnvironment.AMAZON_SAGEMAKER
    cls = SageMakerConfig if sagemaker else ClusterConfig
    return cls.from_json_file(path) if path.endswith(".json") else cls.from_yaml_file(path)
