"""Launch helpers at Accelerate's ``utils.launch`` path: the per-process wrapper and the environment pieces.

``notebook_launcher`` (notebook_accel.launchers) is our launcher; ``PrepareForLaunch`` is the small
piece a hand-written ``torch.multiprocessing`` launch needs: it turns the process index into the
torchrun variables before calling the function.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from .._lazy import attach
from .constants import DEEPSPEED_MULTINODE_LAUNCHERS
from .enums import DistributedType, DynamoBackend, PrecisionType, SageMakerDistributedType
from .environment import str_to_bool
from .imports import (
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
from .network import get_free_port, is_port_in_use
from .other import merge_dicts
from .versions import compare_versions

__all__ = ["PrepareForLaunch", "env_var_path_add", "setup_fp8_env"]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "DEEPSPEED_MULTINODE_LAUNCHERS",
    "DistributedType",
    "DynamoBackend",
    "PrecisionType",
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
# The config-file dataclass lives with the commands that read the file (above utils): served lazily.
_LAZY = {"SageMakerConfig": "notebook_accel.commands.config.config_args"}
__all__ += sorted(_LAZY)
__getattr__, __dir__ = attach(__name__, _LAZY)


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


class PrepareForLaunch:
    """A picklable wrapper that sets one process's rank variables, then calls ``launcher(*args)``.

    Built for ``torch.multiprocessing.start_processes(PrepareForLaunch(fn, "MULTI_CPU"), args=..., nprocs=n)``:
    process ``index`` gets ``LOCAL_RANK=index`` and ``RANK = NODE_RANK * nprocs + index`` (``nprocs`` from
    ``LOCAL_WORLD_SIZE``, else ``NPROC``, else ``WORLD_SIZE``). With ``debug`` it also sets
    ``ACCELERATE_DEBUG_MODE`` so collectives check their inputs.

    Args:
        launcher: The function each process runs.
        distributed_type: How the run is distributed ("MULTI_CPU", "MULTI_GPU", ...).
        debug: Turn on the collectives' input checks (``ACCELERATE_DEBUG_MODE``).
    """

    def __init__(self, launcher: Callable, distributed_type: Any = "NO", debug: bool = False) -> None:
        if not callable(launcher):
            raise TypeError(f"PrepareForLaunch needs a function to launch, got {launcher!r}")
        if distributed_type not in DistributedType:
            raise ValueError(
                f"PrepareForLaunch: distributed_type={distributed_type!r} is not valid; "
                f"choose one of {DistributedType.list()}"
            )
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> Any:
        if self.distributed_type != DistributedType.NO or self.debug:
            local_size = (
                os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NPROC") or os.environ.get("WORLD_SIZE")
            )
            node_rank = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
            os.environ["LOCAL_RANK"] = str(index)
            os.environ["RANK"] = str(node_rank * int(local_size or 1) + index)
        os.environ["FORK_LAUNCHED"] = "1"
        if self.debug:
            os.environ["ACCELERATE_DEBUG_MODE"] = "true"
        return self.launcher(*args)
