"""get_quantized_model_device_map and quantize_and_offload_8bit on the CPU (no bitsandbytes, no GPU needed)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from notebook_accel.integrations.quantization import bnb as bnb_utils
from notebook_accel.utils import BnbQuantizationConfig, infer_auto_device_map
from notebook_accel.utils.bnb import get_quantized_model_device_map, quantize_and_offload_8bit
from notebook_accel.utils.offload import load_offloaded_weight


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Each layer: 64x64 weight + 64 bias = 4160 values (16,640 bytes fp32, 8,320 fp16, 4,160 int8).
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))


EIGHT = BnbQuantizationConfig(load_in_8bit=True, skip_modules=[])
FOUR = BnbQuantizationConfig(load_in_4bit=True, skip_modules=[])


BUDGET = {
    "cpu": 20_000
}  # the CPU is the main device here; the planner also keeps room for an offloaded layer


def test_planned_map_counts_quantized_weights_as_int8() -> None:
    model = _model()  # 16,640 bytes as int8, 66,560 as fp32
    assert infer_auto_device_map(model, max_memory=BUDGET) == {"": "disk"}
    assert get_quantized_model_device_map(model, EIGHT, "sequential", max_memory=BUDGET) == {"": "cpu"}


def test_skipped_and_fp32_modules_are_planned_in_their_own_dtype() -> None:
    model = _model()
    # Layer 0 unquantized in fp16 (8,320 bytes) no longer leaves room for all of it.
    skip = BnbQuantizationConfig(load_in_8bit=True, skip_modules=["0"], torch_dtype=torch.float16)
    assert get_quantized_model_device_map(model, skip, "sequential", max_memory=BUDGET) == {
        "0": "cpu", "1": "cpu", "2": "disk", "3": "disk",
    }  # fmt: skip
    # Kept in fp32 (16,640 bytes) it is worse still.
    fp32 = BnbQuantizationConfig(load_in_8bit=True, skip_modules=[], keep_in_fp32_modules=["0"])
    assert get_quantized_model_device_map(model, fp32, "sequential", max_memory=BUDGET) == {"": "disk"}


def test_default_skip_modules_keep_the_output_head_unquantized() -> None:
    default = BnbQuantizationConfig(load_in_8bit=True, torch_dtype=torch.float16)  # skips the last layer
    planned = get_quantized_model_device_map(_model(), default, "sequential", max_memory=BUDGET)
    assert planned == {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk"}


def test_four_bit_weights_are_planned_at_half_a_byte() -> None:
    model = _model()  # 8,320 bytes in 4 bits, 16,640 in int8
    assert get_quantized_model_device_map(model, FOUR, "sequential", max_memory={0: 9_000}) == {"": 0}
    planned = get_quantized_model_device_map(model, EIGHT, "sequential", max_memory={0: 9_000, "cpu": 10**6})
    assert planned == {"0": 0, "1": "cpu", "2": "cpu", "3": "cpu"}


def test_four_bit_layers_cannot_be_offloaded_unquantized_ones_are_not_blamed() -> None:
    # The maps match accelerate 1.15's get_quantized_model_device_map on the same model and budgets.
    model = _model()
    with pytest.raises(
        ValueError, match=r"4-bit model does not fit.*\['2', '3'\] would go to cpu/disk.*device_map dict"
    ):
        get_quantized_model_device_map(model, FOUR, "sequential", max_memory={0: 7_000, "cpu": 10**6})
    gpu = {0: 13_000, "cpu": 10**6}
    skip_last = BnbQuantizationConfig(load_in_4bit=True, skip_modules=["3"], torch_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"\['2'\] would go to cpu/disk.*'3': 'cpu'\}"):
        get_quantized_model_device_map(model, skip_last, "sequential", max_memory=gpu)
    default = BnbQuantizationConfig(load_in_4bit=True, torch_dtype=torch.float16)  # skips the head "3"
    with pytest.raises(ValueError, match=r"\['2'\] would go to cpu/disk.*'3': 'cpu'\}"):
        get_quantized_model_device_map(model, default, "sequential", max_memory=gpu)


def test_given_and_default_maps(monkeypatch) -> None:
    model = _model()
    given = {"0": "cpu", "1": "disk", "2": 0, "3": 0}
    assert get_quantized_model_device_map(model, FOUR, given) is given
    monkeypatch.setattr(bnb_utils.imports, "is_cuda_available", lambda: False)
    with pytest.raises(RuntimeError, match="current CUDA GPU, and none is visible.*pass device_map="):
        get_quantized_model_device_map(model, EIGHT)
    monkeypatch.setattr(bnb_utils.imports, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert get_quantized_model_device_map(model, EIGHT) == {"": 3}


def test_bad_arguments_are_named() -> None:
    with pytest.raises(
        ValueError, match=r"device_map='fastest' is not a device-map strategy: choose one of .*, or a dict"
    ):
        get_quantized_model_device_map(_model(), EIGHT, "fastest")
    with pytest.raises(TypeError, match="must be a BnbQuantizationConfig.*got dict"):
        get_quantized_model_device_map(_model(), {"load_in_8bit": True}, "auto")


def test_quantize_and_offload_8bit_writes_int8_rows_and_their_scales(tmp_path) -> None:
    model = _model()
    weight = model[1].weight.detach().clone()
    weight[5] = 0.0  # an all-zero row stays zero (no division by zero)
    index = quantize_and_offload_8bit(model, weight, "1.weight", torch.int8, tmp_path, {"x": {}}, None)
    assert sorted(os.listdir(tmp_path)) == ["1.SCB.dat", "1.weight.dat"]
    assert index["x"] == {} and index["1.weight"] == {"dtype": "int8", "shape": [64, 64]}
    assert index["1.SCB"] == {"dtype": "float32", "shape": [64]}
    values = load_offloaded_weight(tmp_path / "1.weight.dat", index["1.weight"])
    scales = load_offloaded_weight(tmp_path / "1.SCB.dat", index["1.SCB"])
    assert torch.equal(scales, weight.abs().amax(dim=1))
    assert values.abs().amax(dim=1)[:5].tolist() == [127] * 5  # each row's largest value maps to +-127
    assert torch.count_nonzero(values[5]) == 0
    restored = values.float() * scales.unsqueeze(1) / 127
    assert torch.all((restored - weight).abs() <= scales.unsqueeze(1) / 254 + 1e-7)  # half a step at most
    assert model[1].weight.device.type == "meta" and model[1].weight.dtype == torch.int8
    assert model[0].weight.device.type == "cpu"


def test_quantize_and_offload_8bit_keeps_given_statistics(tmp_path) -> None:
    model = _model()
    values = torch.randint(-127, 128, (64, 64), dtype=torch.int8)
    scales = torch.rand(64)
    given: dict = {}
    index = quantize_and_offload_8bit(model, values, "2.weight", torch.int8, tmp_path, given, scales)
    # Accelerate's callers ignore the return value: the index they pass is filled in place.
    assert index is given and sorted(given) == ["2.SCB", "2.weight"]
    assert torch.equal(load_offloaded_weight(tmp_path / "2.weight.dat", index["2.weight"]), values)
    assert torch.equal(load_offloaded_weight(tmp_path / "2.SCB.dat", index["2.SCB"]), scales)


def test_quantize_and_offload_8bit_rejects_what_it_cannot_store(tmp_path) -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"'1.bias' is not a weight"):
        quantize_and_offload_8bit(model, model[1].bias, "1.bias", torch.int8, tmp_path, {}, None)
    with pytest.raises(ValueError, match=r"2-D floating weight, got torch.int8.*pass fp16_statistics"):
        quantize_and_offload_8bit(
            model, torch.zeros(64, 64, dtype=torch.int8), "1.weight", torch.int8, tmp_path, {}, None
        )
    with pytest.raises(
        ValueError, match=r"must be int8 with one scale per row; got torch.int8 \(64, 64\) and \(3,\)"
    ):
        quantize_and_offload_8bit(
            model, torch.zeros(64, 64, dtype=torch.int8), "1.weight", torch.int8, tmp_path, {}, torch.ones(3)
        )
    assert os.listdir(tmp_path) == []
