"""Version comparisons, package/device checks and the 1.15 enums and constants (issue 12)."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest
import torch
from torch import nn

from notebook_accel.utils import constants, imports, package_checks, versions
from notebook_accel.utils.device_planning.sizes import dtype_byte_size
from notebook_accel.utils.enums import (
    CustomDtype,
    DDPCommunicationHookType,
    DistributedType,
    FP8BackendType,
    PrecisionType,
)
from notebook_accel.utils.kwargs import DistributedDataParallelKwargs, InitProcessGroupKwargs


def test_compare_versions_reads_installed_metadata_and_version_objects() -> None:
    torch_version = importlib.metadata.version("torch")
    assert versions.compare_versions("torch", "==", torch_version.split("+")[0]) or "+" in torch_version
    assert versions.compare_versions("torch", ">=", "1.0")
    assert not versions.compare_versions("torch", "<", "1.0")
    # A version object compares itself, PEP 440 style (2.10 > 2.9, not string order).
    assert versions.compare_versions(torch.torch_version.TorchVersion("2.10.0"), ">", "2.9")


def test_compare_versions_rejects_bad_operation_and_missing_library() -> None:
    with pytest.raises(ValueError, match=r"operation '~=' is not a comparison.*'>='"):
        versions.compare_versions("torch", "~=", "1.0")
    with pytest.raises(importlib.metadata.PackageNotFoundError, match=r"for 'no_such_dist_xyz' \(install it"):
        versions.compare_versions("no_such_dist_xyz", ">=", "1.0")
    with pytest.raises(ValueError, match="operation 'gt'"):
        versions.is_torch_version("gt", "2.0")


def test_is_torch_version_compares_installed_torch() -> None:
    assert versions.is_torch_version(">=", "1.0")
    assert versions.is_torch_version("<", "999.0")
    assert imports.is_torch_version is versions.is_torch_version


def test_min_version_arguments_gate_the_answer() -> None:
    assert package_checks.is_numpy_available(min_version="1.0")
    assert not package_checks.is_numpy_available(min_version="999.0")
    assert not imports.is_mps_available(min_version="999.0")
    # bitsandbytes is not installed here: False whatever the minimum.
    assert not package_checks.is_bnb_available() and not package_checks.is_bnb_available("0.1")


def test_package_checks_follow_what_is_importable(monkeypatch) -> None:
    assert package_checks.is_tqdm_available()
    assert not package_checks.is_peft_available() or importlib.util.find_spec("peft")
    assert package_checks.is_package_available("json")
    assert not package_checks.is_package_available("no_such_module_xyz")
    assert package_checks.is_rich_available.__name__ == "is_rich_available"


def test_device_checks_answer_without_devices() -> None:
    assert imports.is_torch_distributed_available() == torch.distributed.is_available()
    assert imports.is_rocm_available() == (torch.version.hip is not None)
    assert imports.is_weights_only_available()
    for check in (imports.is_mlu_available, imports.is_musa_available, imports.is_sdaa_available):
        assert check() is False and check(check_device=True) is False
    assert imports.is_hpu_available() is False and imports.is_habana_gaudi1() is False
    assert imports.is_fp16_available() is True
    if not torch.cuda.is_available():
        assert imports.is_fp8_available() is False


def test_vendor_device_reports_a_registered_backend(monkeypatch) -> None:
    """A vendor plugin that registers ``torch.mlu`` with a device makes is_mlu_available True."""
    fake = types.ModuleType("torch_mlu")
    monkeypatch.setitem(sys.modules, "torch_mlu", fake)
    monkeypatch.setattr(package_checks.importlib.util, "find_spec", lambda name: object())
    package_checks.is_package_available.cache_clear()
    backend = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)
    monkeypatch.setattr(torch, "mlu", backend, raising=False)
    try:
        assert imports.is_mlu_available(check_device=True) is True
        backend.is_available = lambda: False
        assert imports.is_mlu_available() is False
    finally:
        package_checks.is_package_available.cache_clear()


def test_deepspeed_required_and_torchao_required_raise_with_the_way_out(monkeypatch) -> None:
    @imports.torchao_required
    def quantize() -> str:
        return "done"

    with pytest.raises(ImportError, match=r"quantize needs torchao: pip install torchao"):
        quantize()
    monkeypatch.setattr(imports, "is_torchao_available", lambda: True)
    assert quantize() == "done" and quantize.__name__ == "quantize"

    @imports.deepspeed_required
    def engine_step() -> str:
        return "stepped"

    with pytest.raises(ImportError, match="pip install deepspeed"):
        engine_step()
    monkeypatch.setattr(imports, "is_deepspeed_available", lambda: True)
    with pytest.raises(ValueError, match=r"only runs when DeepSpeed is enabled.*ACCELERATE_USE_DEEPSPEED"):
        engine_step()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert engine_step() == "stepped"


def test_enums_of_1_15() -> None:
    assert DistributedType.MULTI_NEURON == "MULTI_NEURON"
    assert "bf16" in DDPCommunicationHookType and "power_sgd" in DDPCommunicationHookType
    assert "TE" in FP8BackendType and "XYZ" not in FP8BackendType
    assert "fp8" in PrecisionType
    assert [dtype_byte_size(d) for d in (CustomDtype.INT4, CustomDtype.INT2, CustomDtype.FP8)] == [
        0.5,
        0.25,
        1,
    ]


def test_constants_used_by_clients() -> None:
    assert nn.Linear in constants.SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
    assert nn.Embedding not in constants.SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
    assert constants.STR_OPERATION_TO_FUNC[">="](2, 1)
    assert set(constants.CUDA_DISTRIBUTED_TYPES) <= set(constants.TORCH_DISTRIBUTED_OPERATION_TYPES)
    assert constants.PROFILE_PATTERN_NAME.format(suffix=3) == "profile_3.json"


def test_kwargs_defaults_of_1_15() -> None:
    # timeout=None leaves torch's per-backend default: nothing is passed on.
    assert InitProcessGroupKwargs().timeout is None
    assert "timeout" not in InitProcessGroupKwargs().to_kwargs()
    ddp = DistributedDataParallelKwargs(comm_hook="POWER_SGD", comm_wrapper="fp16")
    assert ddp.comm_hook is DDPCommunicationHookType.POWER_SGD and ddp.comm_wrapper == "fp16"
    assert DistributedDataParallelKwargs().comm_hook is DDPCommunicationHookType.NO
