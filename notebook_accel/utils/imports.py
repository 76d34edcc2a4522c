"""Environment checks: which optional packages are installed and which devices exist.

Package checks use ``importlib.util.find_spec`` (nothing is imported) and are cached. Device
checks never initialise CUDA: they go through NVML (``torch.cuda.device_count``), so a notebook
kernel stays safe to fork after asking.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.metadata
import logging
import os
from collections.abc import Callable, Iterator

import torch

from .environment import parse_flag_from_env, patch_environment, str_to_bool

# Accelerate 1.15 serves every package check at this path too: all of package_checks' names, listed there.
from .package_checks import *  # noqa: F403
from .package_checks import __all__ as _PACKAGE_CHECKS
from .package_checks import is_deepspeed_available, is_package_available, is_torchao_available
from .versions import compare_versions, is_torch_version

__all__ = [
    "USE_TORCH_XLA",
    "compare_versions",
    "cuda_device_count",
    "deepspeed_required",
    "is_bf16_available",
    "is_cuda_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_ipex_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_rocm_available",
    "is_sdaa_available",
    "is_torch_distributed_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_tpu_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
    "parse_flag_from_env",
    "patch_environment",
    "str_to_bool",
    "torchao_required",
]
__all__ += _PACKAGE_CHECKS

logger = logging.getLogger(__name__)

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


def is_mps_available(min_version: str = "1.12") -> bool:
    """Return whether Apple's MPS backend is built and usable with torch ``min_version`` or newer."""
    mps = getattr(torch.backends, "mps", None)  # absent from old or stripped-down torch builds
    return mps is not None and mps.is_built() and mps.is_available() and is_torch_version(">=", min_version)


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
    importlib.import_module("torch_npu")  # importing it is what adds torch.npu
    backend = getattr(torch, "npu", None)
    if backend is None:
        return False
    if not check_device:
        return bool(backend.is_available())
    try:  # counting devices starts the NPU runtime, which raises when the driver finds none
        return backend.device_count() > 0 and bool(backend.is_available())
    except RuntimeError:
        return False


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


# Accelerate reads this once at import: ``USE_TORCH_XLA=0`` hides torch_xla from every check.
USE_TORCH_XLA = parse_flag_from_env("USE_TORCH_XLA", default=True)


def _vendor_device(module: str, attribute: str, check_device: bool) -> bool:
    """Return whether vendor plugin ``module`` is installed and ``torch.<attribute>`` reports a device."""
    if not is_package_available(module):
        return False
    importlib.import_module(module)  # registers torch.<attribute>
    backend = getattr(torch, attribute, None)
    if backend is None:
        return False
    if check_device:
        try:
            backend.device_count()
        except RuntimeError:
            return False
    return bool(backend.is_available())


def is_mlu_available(check_device: bool = False) -> bool:
    """Return whether a Cambricon MLU is usable (``torch_mlu`` installed, ``torch.mlu`` has a device)."""
    return _vendor_device("torch_mlu", "mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    """Return whether a Moore Threads MUSA device is usable (``torch_musa``)."""
    return _vendor_device("torch_musa", "musa", check_device)


def is_sdaa_available(check_device: bool = False) -> bool:
    """Return whether a Tecorigin SDAA device is usable (``torch_sdaa``)."""
    return _vendor_device("torch_sdaa", "sdaa", check_device)


def is_neuron_available(check_device: bool = False) -> bool:
    """Return whether an AWS Neuron device is usable (``torch_neuronx``)."""
    return _vendor_device("torch_neuronx", "neuron", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Return whether ``habana_frameworks`` is installed and an HPU (Intel Gaudi) is present.

    With ``init_hccl`` the HCCL collectives are loaded too, so a process group can use them.
    """
    if not is_package_available("habana_frameworks"):
        return False
    import habana_frameworks.torch  # noqa: F401  (registers torch.hpu)

    if init_hccl:
        import habana_frameworks.torch.distributed.hccl  # noqa: F401
    return hasattr(torch, "hpu") and bool(torch.hpu.is_available())


def is_habana_gaudi1() -> bool:
    """Return whether the HPU here is a first-generation Gaudi (no fp8, no fp16 there)."""
    if not is_hpu_available():
        return False
    device_info = importlib.import_module("habana_frameworks.torch.utils.experimental")
    return device_info._get_device_type() == device_info.synDeviceType.synDeviceGaudi


def is_rocm_available() -> bool:
    """Return whether this torch is a ROCm (AMD HIP) build."""
    return getattr(torch.version, "hip", None) is not None


def is_xccl_available() -> bool:
    """Return whether torch.distributed has the XCCL backend (Intel GPUs)."""
    check = getattr(torch.distributed, "is_xccl_available", None)
    return bool(check is not None and check())


def is_torch_distributed_available() -> bool:
    """Return whether this torch build has ``torch.distributed``."""
    return torch.distributed.is_available()


def is_weights_only_available() -> bool:
    """Return whether ``torch.load(weights_only=True)`` takes an allowlist (``add_safe_globals``)."""
    return hasattr(torch.serialization, "add_safe_globals")


def is_fp16_available() -> bool:
    """Return whether fp16 mixed precision is supported here (everywhere but first-generation Gaudi)."""
    return not is_habana_gaudi1()


def is_fp8_available() -> bool:
    """Return whether fp8 is supported: a CUDA device of compute capability 8.9 or newer, or a Gaudi 2+ HPU."""
    if is_hpu_available():
        return not is_habana_gaudi1()
    if is_cuda_available():
        capability = _nvml_compute_capability(0)
        return capability is not None and capability >= (8, 9)
    return False


def deepspeed_required(func: Callable) -> Callable:
    """Return ``func`` wrapped to raise unless DeepSpeed is installed and enabled for this run."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if not is_deepspeed_available():
            raise ImportError(f"{func.__qualname__} needs DeepSpeed: pip install deepspeed")
        if not parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
            raise ValueError(
                f"{func.__qualname__} only runs when DeepSpeed is enabled: pass "
                "Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) or set ACCELERATE_USE_DEEPSPEED=true"
            )
        return func(*args, **kwargs)

    return wrapper


def torchao_required(func: Callable) -> Callable:
    """Return ``func`` wrapped to raise ImportError unless ``torchao`` is installed."""
    # Looked up at each call, so the answer follows the module's is_torchao_available.
    return _when_installed(func, lambda: is_torchao_available(), "torchao: pip install torchao")


def _when_installed(func: Callable, installed: Callable[[], bool], package: str) -> Callable:
    """Return ``func`` guarded by ``installed()``: without the package a call raises ImportError naming it."""

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        if installed():
            return func(*args, **kwargs)
        raise ImportError(f"{func.__qualname__} needs {package}")

    return guarded
