"""notebook_accel.utils.offload: offload files, the lazy weights loader, and module alignment."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from notebook_accel.hooks import AlignDevicesHook, add_hook_to_module
from notebook_accel.utils import align_module_device, has_offloaded_params
from notebook_accel.utils.offload import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offloaded_weight,
    load_offloaded_weights,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(3, 4), (5,), ()])
def test_offload_weight_round_trip(tmp_path, dtype, shape) -> None:
    weight = (torch.randn(shape) * 10).to(dtype)
    index = offload_weight(weight, "a.b", tmp_path)
    assert index == {"a.b": {"dtype": str(dtype).replace("torch.", ""), "shape": list(shape)}}
    loaded = load_offloaded_weight(tmp_path / "a.b.dat", index["a.b"])
    assert loaded.dtype == dtype and loaded.shape == weight.shape and torch.equal(loaded, weight)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


def test_offload_weight_errors(tmp_path) -> None:
    with pytest.raises(TypeError, match="needs a torch.Tensor for 'w'"):
        offload_weight([1, 2], "w", tmp_path)
    with pytest.raises(ValueError, match="'w': it is on the meta device"):
        offload_weight(torch.empty(2, device="meta"), "w", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_offloaded_weight(tmp_path / "missing.dat", {"dtype": "float32", "shape": [1]})
    offload_weight(torch.ones(2), "w", tmp_path)
    with pytest.raises(ValueError, match="Unknown dtype 'floaty'"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "floaty", "shape": [2]})
    with pytest.raises(ValueError, match="holds 8 bytes"):
        load_offloaded_weight(tmp_path / "w.dat", {"dtype": "float32", "shape": [4]})


def test_loaded_weight_is_memory_mapped_copy_on_write(tmp_path) -> None:
    index = offload_weight(torch.zeros(1024), "w", tmp_path)
    loaded = load_offloaded_weight(tmp_path / "w.dat", index["w"])
    with open(tmp_path / "w.dat", "r+b") as f:  # rewrite the file under the mapping
        f.write(torch.ones(1024).numpy().tobytes())
    assert torch.equal(loaded, torch.ones(1024))  # mapped, not read: the file's new bytes show through
    loaded += 1  # private pages: the file is untouched
    again = load_offloaded_weight(tmp_path / "w.dat", index["w"])
    assert torch.equal(again, torch.ones(1024)) and torch.equal(loaded, torch.full((1024,), 2.0))


def test_save_offload_index_merges(tmp_path) -> None:
    save_offload_index({"a": {"dtype": "float32", "shape": [1]}}, tmp_path)
    save_offload_index({"b": {"dtype": "int64", "shape": [2]}}, tmp_path)
    save_offload_index({}, tmp_path)
    assert set(json.loads((tmp_path / "index.json").read_text())) == {"a", "b"}


def test_offload_state_dict_and_load_back(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    sd = model.state_dict()
    offload_state_dict(tmp_path / "off", sd)
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    assert set(index) == set(sd)
    fresh = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    load_offloaded_weights(fresh, index, tmp_path / "off")
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, sd[key])
    load_offloaded_weights(fresh, {}, tmp_path / "off")  # nothing to do
    extra = offload_weight(torch.ones(3), "nope", tmp_path / "off")
    with pytest.raises(ValueError, match="does not have a parameter or a buffer named 'nope'"):
        load_offloaded_weights(fresh, extra, tmp_path / "off")
    bad = offload_weight(torch.ones(5), "0.bias", tmp_path / "bad")
    with pytest.raises(ValueError, match=r"'0.bias' of \w+ has shape \(3,\), the value \(5,\)"):
        load_offloaded_weights(fresh, bad, tmp_path / "bad")


def test_offload_state_dict_leaves_nothing_half_written(tmp_path) -> None:
    sd = {"a": torch.ones(2), "b": torch.empty(2, device="meta")}
    with pytest.raises(ValueError, match="'b': it is on the meta device"):
        offload_state_dict(tmp_path, sd)
    assert os.listdir(tmp_path) == []


def test_loader_state_dict_dat_and_safetensors(tmp_path) -> None:
    cpu = {"c": torch.arange(3.0)}
    offload_state_dict(tmp_path / "off", {"d": torch.full((2, 2), 7.0)})
    tensors = {"s.weight": torch.randn(64, 64), "s.half": torch.randn(8).half()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = json.loads((tmp_path / "off" / "index.json").read_text())
    index["e"] = {
        "safetensors_file": str(tmp_path / "model.safetensors"),
        "weight_name": "s.weight",
        "dtype": "float32",
    }
    index["f"] = {"safetensors_file": "model.safetensors", "weight_name": "s.half", "dtype": "float32"}
    os.rename(tmp_path / "model.safetensors", tmp_path / "off" / "model.safetensors")
    index["e"]["safetensors_file"] = str(tmp_path / "off" / "model.safetensors")
    loader = OffloadedWeightsLoader(state_dict=cpu, save_folder=tmp_path / "off", index=index)
    assert list(loader) == ["c", "d", "e", "f"] and len(loader) == 4 and "e" in loader and "zz" not in loader
    assert loader["c"] is cpu["c"]
    assert torch.equal(loader["d"], torch.full((2, 2), 7.0))
    e = loader["e"]
    assert torch.equal(e, tensors["s.weight"])
    # Zero copy: the tensor is a view into the mapped file, and repeated reads reuse it.
    assert e.untyped_storage().nbytes() == os.path.getsize(tmp_path / "off" / "model.safetensors")
    assert loader["e"].data_ptr() == e.data_ptr()
    # Relative file name (resolved against the folder) and dtype conversion on read.
    assert loader["f"].dtype == torch.float32 and torch.allclose(loader["f"], tensors["s.half"].float())
    assert loader.source("c") == "cpu" and loader.source("e") == "disk"
    assert "1 in memory, 3 on disk" in repr(loader)
    with pytest.raises(KeyError):
        loader["zz"]


def test_loader_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="nothing to read: give it `state_dict`.*`save_folder`.*`index`"):
        OffloadedWeightsLoader()
    with pytest.raises(
        FileNotFoundError, match=r"offload folder '.*' has no index.json: .* pass the index yourself"
    ):
        OffloadedWeightsLoader(save_folder=tmp_path)
    loader = OffloadedWeightsLoader(index={"w": {"dtype": "float32", "shape": [1]}})
    with pytest.raises(ValueError, match="no `save_folder`"):
        loader["w"]
    missing = OffloadedWeightsLoader(index={"w": {"safetensors_file": str(tmp_path / "gone.safetensors")}})
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        missing["w"]
    save_file({"x": torch.ones(1)}, str(tmp_path / "m.safetensors"))
    wrong = OffloadedWeightsLoader(
        index={"w": {"safetensors_file": str(tmp_path / "m.safetensors"), "weight_name": "y"}}
    )
    with pytest.raises(KeyError, match="'y' is not in the safetensors file"):
        wrong["w"]


def test_prefixed_dataset_and_extract() -> None:
    data = {"a.x": 1, "a.y": 2, "ab.z": 3, "b": 4}
    view = PrefixedDataset(data, "a.")
    assert list(view) == ["x", "y"] and len(view) == 2 and view["x"] == 1 and "y" in view and "z" not in view
    assert view.source("x") == "unknown"
    sd = {"a.x": torch.ones(1), "ab.z": torch.ones(1), "b": torch.ones(1)}
    assert set(extract_submodules_state_dict(sd, ["a"])) == {"a.x"}
    assert set(extract_submodules_state_dict(sd, ["a", "b"])) == {"a.x", "b"}
    assert set(extract_submodules_state_dict(sd, [""])) == set(sd)


def test_has_offloaded_params_and_align_module_device() -> None:
    lin = nn.Linear(2, 2)
    assert not has_offloaded_params(lin)
    with align_module_device(lin):
        assert lin.weight.device.type == "cpu"
    with align_module_device(lin, execution_device="meta"):
        assert lin.weight.device.type == "meta"
    assert lin.weight.device.type == "cpu"

    weight = lin.weight.detach().clone()
    add_hook_to_module(lin, AlignDevicesHook("cpu", offload=True))
    assert has_offloaded_params(lin) and lin.weight.device.type == "meta"
    with align_module_device(lin):
        assert torch.equal(lin.weight, weight)
    assert lin.weight.device.type == "meta"
    with align_module_device(lin, execution_device="meta"):
        assert lin.weight.device.type == "meta"
    assert lin._hf_hook.execution_device == "cpu"


def test_relative_safetensors_file_inside_the_folder_first_then_the_working_directory(tmp_path, monkeypatch):
    # Accelerate opens a relative safetensors_file from the working directory; peft 0.21 writes its
    # adapters' offload index that way. A file inside the offload folder still wins.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd").mkdir()
    (tmp_path / "off" / "cwd").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, tmp_path / "cwd" / "a.safetensors")
    index = {
        "w": {"safetensors_file": "cwd/a.safetensors", "weight_name": "w", "dtype": "float32", "shape": [2]}
    }
    loader = OffloadedWeightsLoader(save_folder=tmp_path / "off", index=index)
    assert torch.equal(loader["w"], torch.ones(2))
    save_file({"w": torch.zeros(2)}, tmp_path / "off" / "cwd" / "a.safetensors")
    assert torch.equal(OffloadedWeightsLoader(save_folder=tmp_path / "off", index=index)["w"], torch.zeros(2))
    missing = {"w": {**index["w"], "safetensors_file": "nowhere/a.safetensors"}}
    with pytest.raises(FileNotFoundError, match="nowhere/a.safetensors"):
        OffloadedWeightsLoader(save_folder=tmp_path / "off", index=missing)["w"]


def test_loader_lists_memory_names_first_and_each_name_once() -> None:
    entry = {"dtype": "float32", "shape": [1]}
    loader = OffloadedWeightsLoader(
        state_dict={"b": torch.ones(1), "a": torch.ones(1)}, index={"z": entry, "a": entry}
    )
    assert list(loader) == ["b", "a", "z"] and len(loader) == 3
    assert loader.source("a") == "cpu" and loader.source("z") == "disk"
