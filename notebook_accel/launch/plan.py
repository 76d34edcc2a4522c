"""Resolving the launcher's flags and the machine into one ``LaunchPlan``, once, before forking.

Everything the rest of the launch needs (how many processes, which backend, which port, which
start method, which environment variables each worker gets) is decided here and carried down as
a frozen object; nothing below re-reads ``os.environ`` or re-probes the machine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._alias import alias_worker_env
from ..utils.enums import MIXED_PRECISION_CHOICES, PrecisionType
from ..utils.environment import detect_platform, parse_flag_from_env
from ..utils.imports import cuda_device_count
from .interfaces import WorkerStart
from .request import START_METHODS
from .worker import WorkerSpec, threads_per_worker

if TYPE_CHECKING:
    from .request import LaunchRequest


__all__ = [
    "CUDA_INITIALISING_MODULES",
    "MIXED_PRECISION_CHOICES",
    "START_METHODS",
    "LaunchPlan",
    "check_cuda_not_initialised",
    "detect_platform",
    "resolve_plan",
]

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


def _tpu_present() -> bool:
    return any(
        k in os.environ for k in ("COLAB_TPU_ADDR", "TPU_NAME", "XRT_TPU_CONFIG", "TPU_ACCELERATOR_TYPE")
    )


def _cuda_device_count() -> int:
    return cuda_device_count()


def check_cuda_not_initialised(start_method: str, device_type: str) -> None:
    """Raise RuntimeError when CUDA is initialised here and forked workers would use it.

    Workers on the CPU (``debug_launcher``, a CPU plan) may be forked after CUDA was initialised, as
    DataLoader workers are: they never touch the parent's CUDA context.
    """
    if start_method != "fork" or device_type != "cuda":
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
    mixed_precision: PrecisionType
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
    hosts: tuple[str, ...] = ()
    """The nodes this process drives through their agents (``nodes=``), node 0 first; empty: this machine only."""

    @property
    def world_size(self) -> int:
        """Return the total number of processes over all nodes."""
        return self.num_processes * self.num_nodes

    @property
    def supervised_ranks(self) -> range:
        """Return the ranks this process supervises: every rank with ``hosts``, else this node's."""
        if self.hosts:
            return range(self.world_size)
        base = self.node_rank * self.num_processes
        return range(base, base + self.num_processes)

    def describe(self) -> str:
        """Return the one-line summary the launcher prints before starting."""
        where = "in the calling process" if self.in_process else f"start method {self.start_method}"
        nodes = f" x {self.num_nodes} nodes (node rank {self.node_rank})" if self.num_nodes > 1 else ""
        if self.hosts:
            nodes = f" per node x {len(self.hosts)} node(s) ({', '.join(self.hosts)})"
        return (
            f"Launching {self.num_processes} process(es){nodes} | backend {self.backend} | device {self.device_type} "
            f"| {where} | {self.master_addr}:{self.master_port}"
            + (
                f" | mixed precision {self.mixed_precision.value}"
                if self.mixed_precision != PrecisionType.NO
                else ""
            )
            + (" | debug dry run" if self.debug else "")
        )

    def worker_env(self, local_rank: int, node: int | None = None) -> dict[str, str]:
        """Return the environment of the worker with ``local_rank`` on ``node`` (default: this node's rank) (torchrun contract + ours)."""
        node_rank = self.node_rank if node is None else node
        rank = node_rank * self.num_processes + local_rank
        extra = {"NODE_RANK": str(node_rank)} if self.hosts else {}
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.num_processes),
            "GROUP_RANK": str(node_rank),
            **extra,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            **alias_worker_env(),
            **self.env,
        }

    def worker_starts(
        self,
        ranks: list,
        ends: list[tuple[int, ...]],
        writes: list[int],
        stacks_path: Callable[[int], str],
        **fields: Any,
    ) -> list[WorkerStart]:
        """Return each rank's start over its pipes' write ends ``ends`` (``writes``: every write end).

        ``ranks``: the launch's books (``rank``, ``local_rank``, ``node``, ``fds``: the read ends);
        ``fields``: the rest of each ``WorkerSpec`` (the function, its arguments...).
        """
        # A forked worker closes every other descriptor of the launch: the read ends, the others' write ends.
        parent_fds = [fd for r in ranks for fd in r.fds]
        threads = threads_per_worker(self.num_processes)
        store_ports = tuple(p for p in (self.master_port, self.dry_run_port) if p)
        starts = []
        for r, own in zip(ranks, ends):
            spec = WorkerSpec(
                rank=r.rank,
                local_rank=r.local_rank,
                env=self.worker_env(r.local_rank, r.node),
                num_threads=threads,
                backend=self.backend,
                dry_run_port=self.dry_run_port,
                close_fds=tuple(parent_fds + [fd for fd in writes if fd not in own]),
                parent_pid=os.getpid(),
                stacks_path=stacks_path(r.rank),
                store_ports=store_ports,
                **fields,
            )
            starts.append(WorkerStart(spec, *own))
        return starts


def resolve_plan(request: LaunchRequest, gpus: int | None = None) -> LaunchPlan:
    """Return the ``LaunchPlan`` for ``request`` (checked already) on this machine (``gpus``: the devices per node, if known).

    Only what depends on the machine is decided (and can fail) here: the platform, the devices, the
    debug flag, whether CUDA was initialised before a fork.
    """
    num_nodes = request.num_nodes
    common = {
        "start_method": request.start_method,
        "master_addr": request.master_addr,
        "master_port": request.master_port,
        "mixed_precision": request.mixed_precision,
        "platform": detect_platform(),
        "num_nodes": num_nodes,
        "node_rank": request.node_rank,
        "debug": parse_flag_from_env("ACCELERATE_DEBUG_MODE"),
    }
    env = {"ACCELERATE_MIXED_PRECISION": request.mixed_precision.value, "ACCELERATE_FORK_LAUNCHED": "1"}
    if common["debug"]:
        env["ACCELERATE_DEBUG_MODE"] = "1"
    asked = request.num_processes
    if not request.force_cpu and common["platform"] in ("colab", "kaggle") and _tpu_present():
        return LaunchPlan(
            num_processes=asked or 8,
            backend="xla",
            device_type="tpu",
            distributed_type="XLA",
            env=env,
            **common,
        )
    gpus = 0 if request.force_cpu else (_cuda_device_count() if gpus is None else gpus)
    if gpus > 0:
        n = asked if asked is not None else gpus
        if num_nodes == 1 and n > gpus:
            raise ValueError(
                f"num_processes={n} is more than the {gpus} visible CUDA device(s); use at most {gpus}, "
                "or launch on CPU with debug_launcher"
            )
        backend, device, dist_type = "nccl", "cuda", "MULTI_GPU"
    else:
        n = asked if asked is not None else 1
        backend, device, dist_type = "gloo", "cpu", "MULTI_CPU"
        env["ACCELERATE_USE_CPU"] = "1"
    in_process = n == 1 and num_nodes == 1
    if not in_process:
        check_cuda_not_initialised(request.start_method, device)
    return LaunchPlan(
        num_processes=n,
        backend=backend,
        device_type=device,
        distributed_type="NO" if in_process else dist_type,
        in_process=in_process,
        env=env,
        **common,
    )
