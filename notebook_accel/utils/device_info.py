"""Facts about the accelerators here, read without creating a CUDA context (fork stays safe).

GPU names and the driver version come from NVML (the driver's management library), falling back to
``nvidia-smi``; the NUMA node a process should run on comes from NVML's CPU affinity of its GPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess

from .environment import parse_flag_from_env
from .imports import (
    _nvml_compute_capability,
    _nvml_devices,
    _nvml_gpu_memory,
    _nvml_handle,
    is_cuda_available,
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_npu_available,
    is_sdaa_available,
    is_xpu_available,
)

__all__ = [
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "get_current_device_type",
    "get_driver_version",
    "get_gpu_info",
    "override_numa_affinity",
    "set_numa_affinity",
]

logger = logging.getLogger(__name__)

# Accelerate's order when it picks the process's device (state's backend choice), then its fallback.
_DEVICE_ORDER = (
    ("mlu", "MULTI_MLU", is_mlu_available),
    ("sdaa", "MULTI_SDAA", is_sdaa_available),
    ("musa", "MULTI_MUSA", is_musa_available),
    ("npu", "MULTI_NPU", is_npu_available),
    ("hpu", "MULTI_HPU", is_hpu_available),
    ("cuda", "MULTI_GPU", is_cuda_available),
    ("xpu", "MULTI_XPU", is_xpu_available),
)
# Consumer GPUs after the RTX 3090 cannot use peer-to-peer or InfiniBand transfers through NCCL.
_NO_P2P_NAMES = ("RTX 40", "RTX 50")


def get_current_device_type() -> tuple[str, str]:
    """Return ``(device type, distributed type)`` of the first accelerator found, without initialising it.

    The order is MLU, SDAA, MUSA, NPU, HPU, CUDA, XPU; with none, ``("cpu", "MULTI_CPU")``.
    """
    for device, distributed, available in _DEVICE_ORDER:
        if available():
            return device, distributed
    return "cpu", "MULTI_CPU"


def _smi(query: str) -> list[str] | None:
    """Return the lines ``nvidia-smi --query-gpu=<query>`` prints, or None when it is not installed."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """Return ``(names, count)`` of the NVIDIA GPUs this process sees; ``([], 0)`` on a machine without one."""
    gpus = _nvml_gpu_memory()
    if gpus is not None:
        names = [name for name, _, _ in gpus]
        return names, len(names)
    names = _smi("name") or []
    return names, len(names)


def get_driver_version() -> str | None:
    """Return the NVIDIA driver version (e.g. ``"550.54.15"``), or None without an NVIDIA driver."""
    with _nvml_devices() as found:
        if found is not None:
            nvml, _ = found
            buffer = ctypes.create_string_buffer(96)
            if nvml.nvmlSystemGetDriverVersion(buffer, 96) == 0:
                return buffer.value.decode()
    lines = _smi("driver_version")
    return lines[0] if lines else None


def check_cuda_p2p_ib_support() -> bool:
    """Return False when a GPU here is a consumer card after the RTX 3090 (no NCCL P2P / InfiniBand), else True."""
    names, _ = get_gpu_info()
    return not any(marker in name for name in names for marker in _NO_P2P_NAMES)


def check_cuda_fp8_capability() -> bool:
    """Return whether the first CUDA device supports fp8 (compute capability 8.9 or newer)."""
    capability = _nvml_compute_capability(0)
    return capability is not None and capability >= (8, 9)


def _gpu_cpus(local_process_index: int) -> list[int]:
    """Return the CPUs on the NUMA node of GPU ``local_process_index`` (NVML's CPU affinity of that GPU)."""
    words = (os.cpu_count() + 63) // 64
    with _nvml_devices() as found:
        if found is None or local_process_index >= len(found[1]):
            raise RuntimeError(
                f"NUMA affinity needs an NVIDIA GPU {local_process_index} and its driver (NVML); none is visible here"
            )
        nvml, indices = found
        handle = _nvml_handle(nvml, indices[local_process_index])
        mask = (ctypes.c_ulong * words)()
        if handle is None or nvml.nvmlDeviceGetCpuAffinity(handle, words, mask) != 0:
            raise RuntimeError(f"NVML could not report the CPU affinity of GPU {local_process_index}")
    return [w * 64 + bit for w in range(words) for bit in range(64) if mask[w] >> bit & 1]


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPUs of its GPU's NUMA node, recomputing them (see ``set_numa_affinity``).

    ``verbose`` (default: on in ``ACCELERATE_DEBUG_MODE``) logs the assignment.
    """
    cpus = _gpu_cpus(local_process_index)
    os.sched_setaffinity(0, cpus)
    if verbose if verbose is not None else parse_flag_from_env("ACCELERATE_DEBUG_MODE"):
        logger.info("process %d pinned to CPUs %s", local_process_index, cpus)


@functools.lru_cache
def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPUs of its GPU's NUMA node; computed once per process and index."""
    override_numa_affinity(local_process_index, verbose=verbose)
