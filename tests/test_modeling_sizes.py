"""Sizes of tensors, modules and layers; set_module_tensor_to_device; tied parameters; storage identity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from notebook_accel.utils import (
    calculate_maximum_sizes,
    compute_module_sizes,
    compute_module_total_buffer_size,
    convert_file_size_to_int,
    dtype_byte_size,
    find_tied_parameters,
    get_max_layer_size,
    id_tensor_storage,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)
from notebook_accel.utils.modeling import check_tied_parameters_on_same_device


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 8))]
        )
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("cache", torch.zeros(5), persistent=False)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight


def test_convert_file_size_to_int_units() -> None:
    assert convert_file_size_to_int(123) == 123
    assert convert_file_size_to_int("10GiB") == 10 * 2**30
    assert convert_file_size_to_int("10GB") == 10 * 10**9
    assert convert_file_size_to_int("500MB") == 500 * 10**6
    assert convert_file_size_to_int("1.5GiB") == int(1.5 * 2**30)
    assert convert_file_size_to_int("8KiB") == 8192
    assert convert_file_size_to_int("8Gb") == 10**9  # lowercase b: bits
    assert convert_file_size_to_int("1000") == 1000


@pytest.mark.parametrize("bad", ["10 gigs", "GB", "10G", "1.2.3MB", "-5GB", "10XB"])
def test_convert_file_size_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="not in a valid format.*'10GiB'"):
        convert_file_size_to_int(bad)


def test_convert_file_size_rejects_negative_and_types() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        convert_file_size_to_int(-1)
    with pytest.raises(TypeError, match="int or a string"):
        convert_file_size_to_int([1])  # type: ignore[arg-type]


def test_dtype_byte_size() -> None:
    assert dtype_byte_size(torch.float32) == 4
    assert dtype_byte_size(torch.bfloat16) == 2
    assert dtype_byte_size("float16") == 2
    assert dtype_byte_size("torch.int64") == 8
    assert dtype_byte_size(torch.bool) == 1 / 8
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_byte_size("float17")


def test_named_module_tensors() -> None:
    model = Tiny()
    own = dict(named_module_tensors(model))
    assert set(own) == {"scale", "cache"}
    deep = dict(named_module_tensors(model, recurse=True, remove_non_persistent=True))
    assert "cache" not in deep and "norm.running_mean" in deep and "head.weight" in deep
    no_buf = dict(named_module_tensors(model, include_buffers=False, recurse=True))
    assert "scale" not in no_buf and "blocks.0.0.weight" in no_buf


def _expected_sizes(model: nn.Module, dtype=None) -> dict[str, int]:
    out: dict[str, int] = {}
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        size = t.numel() * t.element_size()
        if dtype is not None and t.is_floating_point():
            size = t.numel() * min(t.element_size(), torch.empty(0, dtype=dtype).element_size())
        parts = name.split(".")
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            out[key] = out.get(key, 0) + size
    return out


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_compute_module_sizes_matches_tensor_bytes(device: str) -> None:
    with torch.device(device):
        model = Tiny()
    sizes = compute_module_sizes(model)
    assert dict(sizes) == _expected_sizes(model)
    assert sizes["blocks.0"] == (16 + 4) * 4
    half = compute_module_sizes(model, dtype=torch.float16)
    assert dict(half) == _expected_sizes(model, torch.float16)
    # num_batches_tracked is int64 and is never cast
    assert half["norm.num_batches_tracked"] == 8


def test_compute_module_sizes_special_dtypes_and_buffers() -> None:
    model = Tiny()
    sizes = compute_module_sizes(model, special_dtypes={"head.weight": torch.int8})
    assert sizes["head.weight"] == 80
    buffers = compute_module_sizes(model, buffers_only=True)
    assert buffers[""] == 3 * 4 + 5 * 4 + 8 * 4 * 2 + 8
    assert compute_module_total_buffer_size(model) == buffers[""]


def test_tied_parameters_counted_once() -> None:
    model = TiedLM()
    sizes = compute_module_sizes(model)
    assert sizes[""] == (64 + 16 + 4) * 4
    assert "head" not in sizes or sizes["head"] == 0


def test_get_max_layer_size_and_calculate_maximum_sizes() -> None:
    model = Tiny()
    sizes = compute_module_sizes(model)
    top = list(model.named_children())
    leaves = {n: sizes.get(n, 0) for n, m in model.named_modules() if n and not list(m.children())}
    best = max(leaves.values())
    size, names = get_max_layer_size(top, sizes, [])
    assert size == best == sizes["head"] and names == [n for n, v in leaves.items() if v == best]
    model.head = nn.Linear(8, 2, bias=False)
    sizes = compute_module_sizes(model)
    top = list(model.named_children())
    assert get_max_layer_size(top, sizes, []) == (sizes["embed"], ["embed", "blocks.1.0"])
    size, names = get_max_layer_size(top, sizes, ["ModuleList"])
    assert (size, names) == (sizes["blocks"], ["blocks"])
    model._no_split_modules = ["ModuleList"]
    total, (largest, largest_names) = calculate_maximum_sizes(model)
    assert total == sizes[""] and largest == sizes["blocks"] and largest_names == ["blocks"]


def test_find_and_retie_parameters() -> None:
    model = TiedLM()
    groups = find_tied_parameters(model)
    assert groups == [["embed.weight", "head.weight"]]
    model.head.weight = nn.Parameter(torch.zeros(16, 4))
    assert find_tied_parameters(model) == []
    retie_parameters(model, groups)
    assert model.head.weight is model.embed.weight
    assert find_tied_parameters(nn.Linear(2, 2)) == []


def test_check_tied_parameters_on_same_device(caplog) -> None:
    groups = [["embed.weight", "head.weight"]]
    assert check_tied_parameters_on_same_device(groups, {"embed": 0, "head": 0})
    assert check_tied_parameters_on_same_device(groups, {"": "cpu", "embed.weight": "cpu"})  # prefixes
    with caplog.at_level("WARNING"):
        assert not check_tied_parameters_on_same_device(groups, {"embed": 0, "head": "cpu"})
        assert not check_tied_parameters_on_same_device(groups, {"": 0, "head": "cpu"})
    assert "Tied parameters are on different devices" in caplog.text


def test_set_module_tensor_meta_to_cpu_keeps_class_and_grad() -> None:
    with torch.device("meta"):
        model = Tiny()
    model.head.weight.requires_grad_(False)
    value = torch.randn(10, 8, dtype=torch.float64)
    set_module_tensor_to_device(model, "head.weight", "cpu", value=value)
    param = model.head.weight
    assert isinstance(param, nn.Parameter) and not param.requires_grad
    assert param.dtype == torch.float32 and param.device.type == "cpu"  # cast to the existing dtype
    torch.testing.assert_close(param, value.float())
    set_module_tensor_to_device(model, "scale", "cpu", value=torch.arange(3.0))
    assert "scale" in model._buffers and torch.equal(model.scale, torch.arange(3.0))


def test_set_module_tensor_dtype_rules_and_zero_copy() -> None:
    model = Tiny()
    value = torch.randn(10, 8)
    set_module_tensor_to_device(model, "head.weight", "cpu", value=value, dtype=torch.float16)
    assert model.head.weight.dtype == torch.float16
    # integer values are never cast, even when dtype is given
    set_module_tensor_to_device(
        model, "norm.num_batches_tracked", "cpu", value=torch.tensor(3), dtype=torch.float16
    )
    assert model.norm.num_batches_tracked.dtype == torch.int64
    # matching dtype on the same device: the value's memory is used, not copied
    same = torch.randn(8, 4)
    set_module_tensor_to_device(model, "blocks.1.0.weight", "cpu", value=same)
    assert model.blocks[1][0].weight.data_ptr() == same.data_ptr()
    # no value: cast in place to meta
    set_module_tensor_to_device(model, "blocks.1.0.weight", "meta", dtype=torch.bfloat16)
    assert (
        model.blocks[1][0].weight.device.type == "meta" and model.blocks[1][0].weight.dtype == torch.bfloat16
    )


def test_set_module_tensor_tied_params_map_reuses_tensor() -> None:
    model = TiedLM()
    source = torch.randn(16, 4)
    tied_map: dict = {source.data_ptr(): {}}
    set_module_tensor_to_device(model, "embed.weight", "cpu", value=source, tied_params_map=tied_map)
    assert torch.device("cpu") in tied_map[source.data_ptr()]
    model.head._parameters["weight"] = nn.Parameter(torch.zeros(16, 4))
    set_module_tensor_to_device(model, "head.weight", "cpu", value=source, tied_params_map=tied_map)
    assert model.head.weight is model.embed.weight


def test_set_module_tensor_errors() -> None:
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(ValueError, match="meta device: pass a `value`"):
        set_module_tensor_to_device(model, "head.weight", "cpu")
    with pytest.raises(ValueError, match=r"'head.weight' of \w+ has shape \(10, 8\), the value \(3, 3\)"):
        set_module_tensor_to_device(model, "head.weight", "cpu", value=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="does not have a parameter or a buffer named 'wieght'"):
        set_module_tensor_to_device(model, "head.wieght", "cpu", value=torch.zeros(3))
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        set_module_tensor_to_device(model, "nope.weight", "cpu", value=torch.zeros(3))
    with pytest.raises(ValueError, match="'disk' is not a device"):
        set_module_tensor_to_device(model, "head.weight", "disk", value=torch.zeros(10, 8))


def test_id_tensor_storage() -> None:
    base = torch.zeros(10)
    assert id_tensor_storage(base[:5]) == id_tensor_storage(base[5:])
    assert id_tensor_storage(base)[1] != id_tensor_storage(torch.zeros(10))[1]
    device, ptr, nbytes = id_tensor_storage(torch.empty(4, device="meta"))
    assert device.type == "meta" and nbytes == 16


def test_get_mixed_precision_context_manager(monkeypatch) -> None:
    import contextlib

    from notebook_accel.utils import get_mixed_precision_context_manager

    assert isinstance(get_mixed_precision_context_manager(native_amp=False), contextlib.nullcontext)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    ctx = get_mixed_precision_context_manager(native_amp=True, autocast_kwargs={"cache_enabled": False})
    assert isinstance(ctx, torch.autocast)
    with ctx:
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


def test_convert_file_size_rejects_bool() -> None:
    with pytest.raises(TypeError, match="not True"):
        convert_file_size_to_int(True)
