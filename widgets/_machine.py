"""What this machine offers: RAM (honouring cgroup limits), each GPU's memory, free disk.

Nothing here initialises CUDA: GPU memory is read through NVML (the driver's management library,
which does not create a CUDA context), and through torch only when this process already uses CUDA.
A kernel that will later fork workers stays fork-safe after showing a panel.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import psutil
import torch

from notebook_accel.utils.imports import _nvml_gpu_memory, cuda_device_count

__all__ = ["GpuInfo", "MachineInfo", "machine_info"]

# cgroup v1 reports "no limit" as a huge page-aligned number (2**63 rounded down to a page).
_V1_UNLIMITED = 2**60


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU."""

    index: int
    """Index as torch numbers it (after CUDA_VISIBLE_DEVICES)."""
    name: str
    total: int | None
    """Total memory in bytes (None when it could not be read without initialising CUDA)."""
    free: int | None
    """Free memory in bytes right now (None when unknown)."""


@dataclass(frozen=True)
class MachineInfo:
    """Memory and disk this process can use."""

    ram_total: int
    """Usable RAM in bytes: physical RAM, capped by the cgroup limit (Colab, Kaggle, containers)."""
    ram_available: int
    """RAM that can still be allocated, in bytes (also capped by the cgroup's remaining room)."""
    disk_free: int
    """Free bytes on the disk holding ``disk_path`` (where offload files would go)."""
    disk_path: str = "."
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    cgroup_limit: int | None = None
    """The cgroup memory limit in bytes, when one is set."""

    @property
    def gpu_free_total(self) -> int:
        """Return the summed free memory of the GPUs (unknown memory counts as 0)."""
        return sum(g.free or 0 for g in self.gpus)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_memory(root: str = "/sys/fs/cgroup") -> tuple[int | None, int | None]:
    """Return ``(limit, usage)`` in bytes of this process's memory cgroup (None where there is none).

    cgroup v2 exposes ``memory.max``/``memory.current`` at the unified root; v1 exposes
    ``memory/memory.limit_in_bytes``/``memory.usage_in_bytes``. Colab and Kaggle run in such a
    cgroup, where psutil's total RAM is the host's and overstates what the kernel may use.
    """
    limit = _read_int(os.path.join(root, "memory.max"))
    if limit is not None:
        return limit, _read_int(os.path.join(root, "memory.current"))
    limit = _read_int(os.path.join(root, "memory", "memory.limit_in_bytes"))
    if limit is not None and limit < _V1_UNLIMITED:
        return limit, _read_int(os.path.join(root, "memory", "memory.usage_in_bytes"))
    return None, None


def _nvml_gpus() -> list[GpuInfo] | None:
    """Return the visible GPUs' memory through NVML (the core's fork-safe query), or None when NVML is unusable."""
    found = _nvml_gpu_memory()
    if found is None:
        return None
    return [GpuInfo(index, name, total, free) for index, (name, total, free) in enumerate(found)]


def _gpus() -> tuple[GpuInfo, ...]:
    count = cuda_device_count()
    if count == 0:
        return ()
    gpus = _nvml_gpus()
    if gpus is not None and len(gpus) == count:
        return tuple(gpus)
    if torch.cuda.is_initialized():  # already paid for: asking the runtime costs no fork-safety
        out = []
        for i in range(count):
            free, total = torch.cuda.mem_get_info(i)
            out.append(GpuInfo(i, torch.cuda.get_device_name(i), int(total), int(free)))
        return tuple(out)
    return tuple(GpuInfo(i, "cuda", None, None) for i in range(count))


def machine_info(disk_path: str | os.PathLike = ".", cgroup_root: str = "/sys/fs/cgroup") -> MachineInfo:
    """Return a :class:`MachineInfo` for this process: RAM (cgroup-capped), GPUs (via NVML) and free disk."""
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    limit, usage = _cgroup_memory(cgroup_root)
    if limit is not None:
        total = min(total, limit)
        if usage is not None:
            available = min(available, max(0, limit - usage))
        available = min(available, total)
    path = os.fspath(disk_path)
    probe = path
    while probe and not os.path.exists(probe):  # the offload folder may not exist yet
        probe = os.path.dirname(probe.rstrip(os.sep)) or "."
    disk_free = int(shutil.disk_usage(probe or ".").free)
    return MachineInfo(
        ram_total=total,
        ram_available=available,
        disk_free=disk_free,
        disk_path=path,
        gpus=_gpus(),
        cgroup_limit=limit,
    )
