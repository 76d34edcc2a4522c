"""Resolving the launcher's flags and the machine into one ``LaunchPlan``, once, before forking.

Everything the rest of the launch needs (how many processes, which backend, which port, which
start method, which environment variables each worker gets) is decided here and carried down as
a frozen object; nothing below re-reads ``os.environ`` or re-probes the machine.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

from ..utils._accelerate_alias import alias_worker_env
from ..utils.enums import MIXED_PRECISION_CHOICES
from ..utils.environment import detect_platform, parse_flag_from_env
from ..utils.imports import cuda_device_count
from .ports import check_master_addr, parse_port

logger = logging.getLogger(__name__)

__all__ = [
    "CUDA_INITIALISING_MODULES",
    "MIXED_PRECISION_CHOICES",
    "START_METHODS",
    "LaunchPlan",
    "check_cuda_not_initialised",
    "detect_platform",
    "resolve_plan",
    "threads_per_worker",
]

START_METHODS = ("fork", "spawn", "forkserver")
RDZV_BACKENDS = ("static", "c10d")

# Modules whose import (or first use) is known to initialise CUDA in the importing process, which
# makes a later fork unusable for CUDA. Named in the error so the user knows which cell did it.
CUDA_INITIALISING_MODULES = (
    "bitsandbytes",
    "deepspeed",
    "transformers",
    "accelerate",
    "torchvision.ops",
    "xformers",
    "flash_attn",
    "apex",
    "vllm",
    "triton",
    "cupy",
    "numba.cuda",
    "tensorflow",
    "jax",
    "pycuda.autoinit",
    "torch_tensorrt",
)


def threads_per_worker(num_processes: int, omp_num_threads: str | None = None) -> int:
    """Return the torch threads each of ``num_processes`` workers gets.

    ``OMP_NUM_THREADS`` wins when set; it may be a list of nesting levels (``"4,2"``, valid OpenMP),
    of which the outer level counts. A value that is not a positive integer (list) is ignored with a
    warning, and the cores are shared out as when it is unset.
    """
    if omp_num_threads is None:
        omp_num_threads = os.environ.get("OMP_NUM_THREADS")
    if omp_num_threads:
        outer = omp_num_threads.split(",")[0].strip()
        if outer.isdigit() and int(outer) > 0:
            return int(outer)
        logger.warning(
            "OMP_NUM_THREADS=%r is not a positive integer (or list of them, e.g. '4,2'); ignored, each worker "
            "gets its share of the CPU cores",
            omp_num_threads,
        )
    return max(1, (os.cpu_count() or 1) // num_processes)


def _tpu_present() -> bool:
    return any(
        k in os.environ for k in ("COLAB_TPU_ADDR", "TPU_NAME", "XRT_TPU_CONFIG", "TPU_ACCELERATOR_TYPE")
    )


def _cuda_device_count() -> int:
    return cuda_device_count()


def check_cuda_not_initialised(start_method: str) -> None:
    """Raise RuntimeError when CUDA is initialised here and ``start_method`` is ``"fork"``."""
    if start_method != "fork":
        return
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    loaded = [name for name in CUDA_INITIALISING_MODULES if name in sys.modules]
    culprits = (
        f"Already imported modules known to initialise CUDA: {', '.join(loaded)}."
        if loaded
        else "No module known to do that is imported, so a call such as torch.cuda.current_device(), "
        "tensor.cuda() or torch.cuda.mem_get_info() in an earlier cell did."
    )
    raise RuntimeError(
        "CUDA is already initialised in this process, and a forked worker cannot use CUDA after that "
        f'("Cannot re-initialize CUDA in forked subprocess"). {culprits} Either pass '
        'start_method="spawn" to notebook_launcher, or restart the kernel and call notebook_launcher '
        "before anything touches CUDA (import such libraries inside the launched function)."
    )


@dataclass(frozen=True)
class LaunchPlan:
    """The resolved launch: what runs where, decided once before any process starts."""

    num_processes: int
    """Processes on this node (1 means the function runs in the calling process)."""
    backend: str
    """``"gloo"``, ``"nccl"`` or ``"xla"``."""
    device_type: str
    """``"cpu"``, ``"cuda"`` or ``"tpu"``."""
    distributed_type: str
    """``"NO"``, ``"MULTI_CPU"``, ``"MULTI_GPU"`` or ``"XLA"``."""
    start_method: str
    master_addr: str
    master_port: int
    mixed_precision: str
    platform: str
    """``"local"``, ``"colab"`` or ``"kaggle"``."""
    num_nodes: int = 1
    node_rank: int = 0
    debug: bool = False
    """ACCELERATE_DEBUG_MODE: workers first check that they can form a process group."""
    dry_run_port: int | None = None
    in_process: bool = False
    env: dict[str, str] = field(default_factory=dict)
    """Variables every worker gets on top of the torchrun ones (RANK, WORLD_SIZE, ...)."""

    @property
    def world_size(self) -> int:
        """Return the total number of processes over all nodes."""
        return self.num_processes * self.num_nodes

    def describe(self) -> str:
        """Return the one-line summary the launcher prints before starting."""
        where = "in the calling process" if self.in_process else f"start method {self.start_method}"
        nodes = f" x {self.num_nodes} nodes (node rank {self.node_rank})" if self.num_nodes > 1 else ""
        return (
            f"Launching {self.num_processes} process(es){nodes} | backend {self.backend} | device {self.device_type} "
            f"| {where} | {self.master_addr}:{self.master_port}"
            + (f" | mixed precision {self.mixed_precision}" if self.mixed_precision != "no" else "")
            + (" | debug dry run" if self.debug else "")
        )

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """Return the environment of the worker with ``local_rank`` (torchrun contract + ours)."""
        rank = self.node_rank * self.num_processes + local_rank
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.num_processes),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            **alias_worker_env(),
            **self.env,
        }


def _validate(
    mixed_precision: str, start_method: str, num_nodes: int, node_rank: int, rdzv_backend: str
) -> None:
    if mixed_precision not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported; choose one of {', '.join(MIXED_PRECISION_CHOICES)}"
        )
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method={start_method!r} is not supported; choose one of {', '.join(START_METHODS)}"
        )
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} must be a positive integer")
    if not isinstance(node_rank, int) or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank!r} must be an integer in [0, num_nodes={num_nodes})")
    if rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(
            f"rdzv_backend={rdzv_backend!r} is not supported; choose one of {', '.join(RDZV_BACKENDS)}"
        )


def resolve_plan(
    num_processes: int | None,
    mixed_precision: str = "no",
    use_port: str | int = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    start_method: str = "fork",
    force_cpu: bool = False,
) -> LaunchPlan:
    """Return the ``LaunchPlan`` for these flags on this machine; raise on bad flags."""
    mixed_precision = str(mixed_precision).lower()
    _validate(mixed_precision, start_method, num_nodes, node_rank, rdzv_backend)
    if num_processes is not None and (not isinstance(num_processes, int) or num_processes < 1):
        raise ValueError(f"num_processes={num_processes!r} must be a positive integer or None")
    platform = detect_platform()
    debug = parse_flag_from_env("ACCELERATE_DEBUG_MODE")
    env = {"ACCELERATE_MIXED_PRECISION": mixed_precision, "ACCELERATE_FORK_LAUNCHED": "1"}
    if debug:
        env["ACCELERATE_DEBUG_MODE"] = "1"

    if not force_cpu and platform in ("colab", "kaggle") and _tpu_present():
        n = num_processes or 8
        return LaunchPlan(
            n, "xla", "tpu", "XLA", start_method, master_addr, parse_port(use_port), mixed_precision, platform,
            num_nodes, node_rank, debug, None, False, env,
        )  # fmt: skip

    gpus = 0 if force_cpu else _cuda_device_count()
    if gpus > 0:
        n = num_processes if num_processes is not None else gpus
        if num_nodes == 1 and n > gpus:
            raise ValueError(
                f"num_processes={n} is more than the {gpus} visible CUDA device(s); use at most {gpus}, "
                "or launch on CPU with debug_launcher"
            )
        backend, device, dist_type = "nccl", "cuda", "MULTI_GPU"
    else:
        n = num_processes if num_processes is not None else 1
        backend, device, dist_type = "gloo", "cpu", "MULTI_CPU"
        env["ACCELERATE_USE_CPU"] = "1"
    in_process = n == 1 and num_nodes == 1
    if in_process:
        dist_type = "NO"
    if not in_process:
        check_cuda_not_initialised(start_method)
    # Single node: the launcher binds the port itself (ports.host_store) right before forking.
    # Multi-node: every node must agree on the port, so no silent fallback there.
    port = parse_port(use_port)
    check_master_addr(master_addr)
    return LaunchPlan(
        n, backend, device, dist_type, start_method, master_addr, port, mixed_precision, platform,
        num_nodes, node_rank, debug, None, in_process, env,
    )  # fmt: skip
