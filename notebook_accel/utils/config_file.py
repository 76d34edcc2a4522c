"""Write the default ``accelerate`` configuration file (what ``accelerate config default`` writes)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from .atomic_files import atomic_write
from .enums import check_mixed_precision
from .imports import cuda_device_count, is_mps_available, is_npu_available, is_xpu_available

__all__ = ["default_config_file", "write_basic_config"]

logger = logging.getLogger(__name__)


def _default_config_path() -> str:
    """Return ``$HF_HOME/accelerate/default_config.yaml`` (HF_HOME defaults to ``$XDG_CACHE_HOME/huggingface``)."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache"))
    hf_home = os.path.expanduser(os.environ.get("HF_HOME", os.path.join(cache, "huggingface")))
    return os.path.join(hf_home, "accelerate", "default_config.yaml")


# The path as of import time; write_basic_config recomputes it when called with this default, so a
# later change of HF_HOME / XDG_CACHE_HOME (e.g. in a notebook cell) is honoured.
default_config_file = _default_config_path()


def _yaml_scalar(value: Any) -> str:
    # JSON scalars are valid YAML scalars; strings are quoted only when YAML would misread them.
    if (
        isinstance(value, str)
        and value
        and value.replace("_", "").replace(".", "").isalnum()
        and not value[0].isdigit()
    ):
        if value.lower() not in ("true", "false", "yes", "no", "on", "off", "null", "y", "n"):
            return value
    return json.dumps(value)


def _to_yaml(config: dict[str, Any]) -> str:
    lines = []
    for key, value in config.items():
        if isinstance(value, (dict, list)):
            lines.append(f"{key}: {json.dumps(value)}")  # flow style: valid YAML, readable by yaml.safe_load
        else:
            lines.append(f"{key}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def _basic_config(mixed_precision: str, use_xpu: bool) -> dict[str, Any]:
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    count, kind = cuda_device_count(), "GPU"
    if count == 0 and use_xpu and is_xpu_available():
        count, kind = torch.xpu.device_count(), "XPU"
    elif count == 0 and is_npu_available():
        count, kind = torch.npu.device_count(), "NPU"
    if count > 0:
        config.update(
            distributed_type=f"MULTI_{kind}" if count > 1 else "NO",
            num_processes=count,
            use_cpu=False,
            gpu_ids="all",
        )
    else:  # one process: on the Apple GPU (MPS) where there is one, else on the CPU
        config.update(distributed_type="NO", num_processes=1, use_cpu=not is_mps_available())
    # The keys and values Accelerate 1.15 writes (tests/data/goldens/cli_commands.json, CPU machine).
    config.update(
        downcast_bf16=False,
        enable_cpu_affinity=False,
        machine_rank=0,
        main_training_function="main",
        mixed_precision=mixed_precision,
        num_machines=1,
        rdzv_backend="static",
        same_network=False,
        tpu_use_cluster=False,
        tpu_use_sudo=False,
    )
    return dict(sorted(config.items()))


def write_basic_config(
    mixed_precision="no", save_location: str = default_config_file, *, use_xpu: bool = False
):
    """Return the path written (or False when a file already exists there) after saving a basic config.

    The configuration describes this machine: every visible CUDA GPU (multi-GPU when more than one),
    else XPU (with ``use_xpu``), NPU, MPS, or CPU only. ``mixed_precision`` is "no", "fp16", "bf16" or
    "fp8". A path ending in ``.json`` is written as JSON, anything else as YAML. An existing file is
    never overwritten.

    Args:
        mixed_precision: "no" (default), "fp16", "bf16" or "fp8".
        save_location: Where to write (default: Accelerate's default config file).
        use_xpu: Describe Intel XPUs when no CUDA GPU is visible.
    """
    mixed_precision = check_mixed_precision(mixed_precision)
    if save_location == default_config_file:
        save_location = _default_config_path()
    path = Path(save_location).expanduser()
    if path.exists():
        logger.warning(
            "User configuration already exists at %s, will not override. Run `accelerate config` manually or pass "
            "a different `save_location`.",
            path,
        )
        return False
    config = _basic_config(mixed_precision, use_xpu)
    text = json.dumps(config, indent=2) + "\n" if path.suffix == ".json" else _to_yaml(config)
    atomic_write(str(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path
