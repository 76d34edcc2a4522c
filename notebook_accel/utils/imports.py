"""Environment checks: which optional packages are installed and which devices exist.

Package checks use ``importlib.util.find_spec`` (nothing is imported) and are cached. Device
checks never initialise CUDA: they go through NVML (``torch.cuda.device_count``), so a notebook
kernel stays safe to fork after asking.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import importlib.util
import logging
import operator
import os
from collections.abc import Iterator

import torch

from .environment import parse_flag_from_env

__all__ = [
    "cuda_device_count",
    "is_aim_available",
    "is_bf16_available",
    "is_bnb_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_ipex_available",
    "is_ipython_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_mps_available",
    "is_msamp_available",
    "is_npu_available",
    "is_package_available",
    "is_safetensors_available",
    "is_tensorboard_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_tpu_available",
    "is_tqdm_available",
    "is_transformer_engine_available",
    "is_wandb_available",
    "is_xpu_available",
]

logger = logging.getLogger(__name__)

_OPERATIONS = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


@functools.cache
def is_package_available(name: str, distribution: str | None = None) -> bool:
    """Return True when module ``name`` can be imported (and ``distribution`` is installed, if given)."""
    try:
        if importlib.util.find_spec(name) is None:
            return False
    except (ImportError, ValueError):
        # find_spec raises for a dotted name whose parent is missing, or a half-installed module.
        return False
    if distribution is not None:
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


def is_torch_version(operation: str, version: str) -> bool:
    """Return whether the installed torch version compares to ``version`` with ``operation``.

    ``operation`` is one of ``>``, ``>=``, ``==``, ``!=``, ``<=``, ``<``; ``version`` like ``"2.1.0"``.
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"operation {operation!r} is not a comparison: use one of {list(_OPERATIONS)}")
    from torch.torch_version import TorchVersion

    # TorchVersion compares PEP 440 style against plain strings ("2.13.0+cpu" >= "2.1").
    return _OPERATIONS[operation](TorchVersion(torch.__version__), version)


# ---------------------------------------------------------------------------------------------
# devices


def cuda_device_count() -> int:
    """Return the number of visible CUDA devices without initialising CUDA (NVML-based, fork-safe)."""
    # torch.cuda.device_count() asks NVML first and only falls back to the CUDA runtime when NVML
    # is unusable; torch.cuda.is_available() would call the runtime (poisoning fork) by default.
    return torch.cuda.device_count()


def is_cuda_available() -> bool:
    """Return True when at least one CUDA device is visible; never initialises CUDA."""
    return cuda_device_count() > 0


def _nvml_visible_indices(count: int) -> list[int] | None:
    """Return the NVML indices of the GPUs torch sees, in torch's order, or None for UUID/MIG names.

    ``count`` is the number of physical GPUs NVML reports; ``CUDA_VISIBLE_DEVICES`` entries beyond
    it are dropped, as torch drops them.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in wanted):  # UUIDs / MIG names: let the caller fall back
        return None
    return [int(v) for v in wanted if int(v) < count]


@contextlib.contextmanager
def _nvml_devices() -> Iterator[tuple[ctypes.CDLL, list[int]] | None]:
    """Yield ``(nvml, indices)``: NVML and the NVML indices of the GPUs torch sees (None if NVML can't answer).

    NVML is the driver's management library: asking it creates no CUDA context, so the process
    stays safe to fork. It is shut down when the block ends.
    """
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        yield None
        return
    if nvml.nvmlInit_v2() != 0:
        yield None
        return
    try:
        count = ctypes.c_uint()
        indices = None
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
            indices = _nvml_visible_indices(count.value)
        yield None if indices is None else (nvml, indices)
    finally:
        nvml.nvmlShutdown()


def _nvml_handle(nvml: ctypes.CDLL, index: int) -> ctypes.c_void_p | None:
    """Return NVML's handle of physical GPU ``index`` (inside :func:`_nvml_devices`), or None."""
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
        return None
    return handle


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml_gpu_memory() -> list[tuple[str, int, int]] | None:
    """Return ``(name, total, free)`` bytes per GPU torch sees, read through NVML, or None when NVML fails."""
    with _nvml_devices() as found:
        if found is None:
            return None
        nvml, indices = found
        gpus = []
        for physical in indices:
            handle = _nvml_handle(nvml, physical)
            if handle is None:
                return None
            mem = _NvmlMemory()
            if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
                return None
            name = ctypes.create_string_buffer(96)
            nvml.nvmlDeviceGetName(handle, name, 96)
            gpus.append((name.value.decode(errors="replace"), int(mem.total), int(mem.free)))
        return gpus


def _nvml_compute_capability(index: int = 0) -> tuple[int, int] | None:
    """Return ``(major, minor)`` of CUDA device ``index`` through NVML, or None when NVML fails."""
    with _nvml_devices() as found:
        if found is None or index >= len(found[1]):
            return None
        nvml, indices = found
        handle = _nvml_handle(nvml, indices[index])
        if handle is None:
            return None
        major, minor = ctypes.c_int(), ctypes.c_int()
        if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
            return None
        return major.value, minor.value


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Return whether bf16 is supported here (TPU/XLA counts unless ``ignore_tpu``)."""
    if is_tpu_available() and not ignore_tpu:
        return True
    if is_cuda_available():
        if torch.cuda.is_initialized():
            return torch.cuda.is_bf16_supported()
        # Ask NVML so that checking does not initialise CUDA (which would make forking unsafe).
        capability = _nvml_compute_capability(0)
        if capability is not None:
            return capability[0] >= 8
        return torch.cuda.is_bf16_supported()
    if is_npu_available():
        return False
    if is_mps_available():
        return is_torch_version(">=", "2.6")
    # CPU kernels support bf16.
    return True


def is_mps_available() -> bool:
    """Return whether Apple's MPS backend is built and usable."""
    return (
        hasattr(torch.backends, "mps") and torch.backends.mps.is_available() and torch.backends.mps.is_built()
    )


@functools.cache
def is_ipex_available() -> bool:
    """Return whether intel_extension_for_pytorch is installed for this torch's major.minor version."""
    if not is_package_available("intel_extension_for_pytorch"):
        return False
    try:
        ipex_version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        return False
    torch_mm = ".".join(torch.__version__.split(".")[:2])
    ipex_mm = ".".join(ipex_version.split(".")[:2])
    if torch_mm != ipex_mm:
        logger.warning(
            "intel_extension_for_pytorch %s is built for PyTorch %s.*, but PyTorch %s is installed; "
            "install the matching version to use it",
            ipex_version,
            ipex_mm,
            torch.__version__,
        )
        return False
    return True


def is_npu_available(check_device: bool = False) -> bool:
    """Return whether ``torch_npu`` is installed and, with ``check_device``, an NPU is present."""
    if not is_package_available("torch_npu"):
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    if check_device:
        try:
            torch.npu.device_count()
            return torch.npu.is_available()
        except RuntimeError:
            return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Return whether ``torch_xla`` is installed (optionally: and runs on TPU / on GPU)."""
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be True")
    if not is_package_available("torch_xla"):
        return False
    if check_is_tpu or check_is_gpu:
        try:
            import torch_xla.runtime as xr

            kind = xr.device_type()
        except Exception:
            return False
        return kind == ("TPU" if check_is_tpu else "CUDA")
    return True


def is_tpu_available(check_device: bool = True) -> bool:
    """Return whether ``torch_xla`` is installed and, with ``check_device``, an XLA device exists."""
    if is_cuda_available():
        # Accelerate's rule: with CUDA present, XLA is not used as the TPU path.
        return False
    if not is_package_available("torch_xla"):
        return False
    if check_device:
        try:
            import torch_xla.core.xla_model as xm

            xm.xla_device()
        except RuntimeError:
            return False
    return True


def is_xpu_available(check_device: bool = False) -> bool:
    """Return whether an Intel XPU is usable, unless the user disabled it (``ACCELERATE_USE_XPU=false``)."""
    if os.environ.get("ACCELERATE_USE_XPU") and not parse_flag_from_env("ACCELERATE_USE_XPU", True):
        return False
    if is_ipex_available():
        import intel_extension_for_pytorch  # noqa: F401  (registers torch.xpu on old torch)
    if not hasattr(torch, "xpu"):
        return False
    if check_device:
        try:
            torch.xpu.device_count()
        except RuntimeError:
            return False
    return torch.xpu.is_available()


# ---------------------------------------------------------------------------------------------
# optional packages


def is_safetensors_available() -> bool:
    """Return whether ``safetensors`` is installed."""
    return is_package_available("safetensors")


def is_tqdm_available() -> bool:
    """Return whether ``tqdm`` is installed."""
    return is_package_available("tqdm")


def is_ipython_available() -> bool:
    """Return whether ``IPython`` is installed."""
    return is_package_available("IPython")


def is_bnb_available() -> bool:
    """Return whether ``bitsandbytes`` is installed."""
    return is_package_available("bitsandbytes")


def is_deepspeed_available() -> bool:
    """Return whether ``deepspeed`` is installed."""
    return is_package_available("deepspeed", "deepspeed")


def is_megatron_lm_available() -> bool:
    """Return whether Megatron-LM (``megatron.core``) is installed."""
    return is_package_available("megatron") and is_package_available("megatron.core")


def is_transformer_engine_available() -> bool:
    """Return whether NVIDIA ``transformer_engine`` is installed."""
    return is_package_available("transformer_engine")


def is_msamp_available() -> bool:
    """Return whether Microsoft ``msamp`` (MS-AMP) is installed."""
    return is_package_available("msamp")


def is_tensorboard_available() -> bool:
    """Return whether TensorBoard logging is possible (``tensorboard`` or ``tensorboardX``)."""
    return is_package_available("tensorboard") or is_package_available("tensorboardX")


def is_wandb_available() -> bool:
    """Return whether ``wandb`` is installed."""
    return is_package_available("wandb")


def is_comet_ml_available() -> bool:
    """Return whether ``comet_ml`` is installed."""
    return is_package_available("comet_ml")


def is_mlflow_available() -> bool:
    """Return whether ``mlflow`` is installed."""
    return is_package_available("mlflow")


def is_aim_available() -> bool:
    """Return whether ``aim`` is installed."""
    return is_package_available("aim")


def is_clearml_available() -> bool:
    """Return whether ``clearml`` is installed."""
    return is_package_available("clearml")


def is_dvclive_available() -> bool:
    """Return whether ``dvclive`` is installed."""
    return is_package_available("dvclive")
