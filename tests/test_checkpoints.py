"""Checkpoint I/O: sharding, the four checkpoint forms, device maps with cpu/disk, dtypes, strictness, errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from notebook_accel.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    load_checkpoint_in_model,
    load_state_dict,
    shard_checkpoint,
)
from notebook_accel.utils.modeling import find_checkpoint_files


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x) + x
        return self.head(self.norm(x) * self.scale)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net().eval()
    with torch.no_grad():
        net.norm.running_mean.normal_()
        net.norm.running_var.uniform_(0.5, 2.0)
    return net


def meta_net() -> Net:
    with torch.device("meta"):
        return Net().eval()


IDS = torch.tensor([1, 4, 7, 11])


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    # Saved once per tied group, as save_model does: head.weight is absent.
    return {k: v.contiguous() for k, v in net.state_dict().items() if k != "head.weight"}


def save_checkpoint(folder, state: dict, form: str, max_shard_size="700B") -> str:
    """Write ``state`` in one of the four forms and return what to pass as ``checkpoint``."""
    os.makedirs(folder, exist_ok=True)
    safe = form.endswith("safetensors")
    name = SAFE_WEIGHTS_NAME if safe else WEIGHTS_NAME
    shards, index = shard_checkpoint(state, max_shard_size=max_shard_size, weights_name=name)
    for shard_name, shard in shards.items():
        path = os.path.join(folder, shard_name)
        if safe:
            save_file(shard, path, metadata={"format": "pt"})
        else:
            torch.save(shard, path)
    if index is not None:
        with open(os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME if safe else WEIGHTS_INDEX_NAME), "w") as f:
            json.dump(index, f)
    if form.startswith("file"):
        assert index is None
        return os.path.join(folder, name)
    if form.startswith("index"):
        return os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME if safe else WEIGHTS_INDEX_NAME)
    return str(folder)


def test_shard_checkpoint_greedy_in_order() -> None:
    gb = 2**20  # use MiB-sized "units" to keep the test light
    sizes = [6, 6, 2, 6, 2, 2]
    state = {f"w{i}": torch.zeros(s * gb // 4) for i, s in enumerate(sizes)}
    shards, index = shard_checkpoint(state, max_shard_size=10 * gb)
    assert [list(s) for s in shards.values()] == [["w0"], ["w1", "w2"], ["w3", "w4", "w5"]]
    assert list(shards) == [f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == 24 * gb
    assert index["weight_map"]["w4"] == "pytorch_model-00003-of-00003.bin"
    # a tensor larger than the limit sits alone
    big = {"a": torch.zeros(2), "b": torch.zeros(100), "c": torch.zeros(2)}
    shards, _ = shard_checkpoint(big, max_shard_size=40, weights_name="model.safetensors")
    assert [list(s) for s in shards.values()] == [["a"], ["b"], ["c"]]
    assert list(shards)[0] == "model-00001-of-00003.safetensors"
    single, none = shard_checkpoint(big, max_shard_size="10GB")
    assert none is None and list(single) == [WEIGHTS_NAME]
    with pytest.raises(ValueError, match="not in a valid format"):
        shard_checkpoint(big, max_shard_size="ten gigs")


FORMS = ["file-safetensors", "file-bin", "index-safetensors", "index-bin", "folder-safetensors", "folder-bin"]


@pytest.mark.parametrize("form", FORMS + ["folder1-safetensors", "folder1-bin"])
def test_round_trip_forward_equal(tmp_path, form: str) -> None:
    original = make_net()
    single = form.startswith(("file", "folder1"))
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), form, "1GB" if single else "700B")
    if not single:
        assert len([f for f in os.listdir(tmp_path / "ckpt") if not f.endswith(".json")]) > 1
    model = meta_net()
    load_checkpoint_in_model(model, checkpoint, strict=True)
    assert model.head.weight is model.embed.weight  # tie restored
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    torch.testing.assert_close(model(IDS), original(IDS))


def test_safetensors_cpu_load_is_zero_copy(tmp_path) -> None:
    original = make_net()
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), "file-safetensors", "1GB")
    model = meta_net()
    load_checkpoint_in_model(model, checkpoint, device_map={"": "cpu"})
    if os.path.exists("/proc/self/maps"):
        # The parameter's memory lies inside a mapping of the checkpoint file: nothing was copied.
        spans = []
        for line in open("/proc/self/maps"):
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == os.path.realpath(checkpoint):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                spans.append((lo, hi))
        ptr = model.layers[0][0].weight.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in spans), spans
    # Writing to the model does not touch the file (copy-on-write).
    with torch.no_grad():
        model.layers[0][0].weight.add_(1.0)
    torch.testing.assert_close(load_state_dict(checkpoint)["layers.0.0.weight"], original.layers[0][0].weight)


def test_safetensors_preferred_when_both_formats_exist(tmp_path) -> None:
    state = _state(make_net())
    folder = tmp_path / "both"
    save_checkpoint(folder, state, "folder-bin", "1GB")
    save_checkpoint(folder, state, "folder-safetensors", "1GB")
    files, index = find_checkpoint_files(folder)
    assert files == [str(folder / SAFE_WEIGHTS_NAME)] and index is None
    save_checkpoint(tmp_path / "sharded", state, "folder-bin", "700B")
    save_checkpoint(tmp_path / "sharded", state, "folder-safetensors", "700B")
    files, index = find_checkpoint_files(tmp_path / "sharded")
    assert index.endswith(SAFE_WEIGHTS_INDEX_NAME) and all(f.endswith(".safetensors") for f in files)


def test_load_state_dict_with_device_map_skips_disk(tmp_path) -> None:
    state = _state(make_net())
    path = tmp_path / "m.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    loaded = load_state_dict(path, device_map={"": "cpu", "layers": "disk"})
    assert "embed.weight" in loaded and not any(k.startswith("layers.") for k in loaded)
    bin_path = tmp_path / "m.bin"
    torch.save(state, bin_path)
    assert set(load_state_dict(bin_path)) == set(state)


def test_device_map_with_disk_points_into_safetensors(tmp_path) -> None:
    original = make_net()
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), "folder-safetensors")
    offload = tmp_path / "offload"
    model = meta_net()
    device_map = {
        "embed": "cpu",
        "head": "cpu",
        "layers.0": "cpu",
        "layers.1": "disk",
        "layers.2": "disk",
        "norm": "cpu",
        "scale": "cpu",
    }
    load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=offload)
    # nothing copied: only the index was written
    assert sorted(os.listdir(offload)) == ["index.json"]
    index = json.loads((offload / "index.json").read_text())
    entry = index["layers.1.0.weight"]
    assert (
        entry["weight_name"] == "layers.1.0.weight"
        and entry["shape"] == [8, 8]
        and entry["dtype"] == "float32"
    )
    assert os.path.isfile(entry["safetensors_file"])
    assert model.layers[1][0].weight.device.type == "meta"
    assert model.layers[0][0].weight.device.type == "cpu"
    from notebook_accel.utils import OffloadedWeightsLoader

    loader = OffloadedWeightsLoader(save_folder=offload)
    torch.testing.assert_close(loader["layers.2.0.bias"], original.layers[2][0].bias)


def test_device_map_with_disk_from_bin_writes_dat_files(tmp_path) -> None:
    original = make_net()
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), "file-bin", "1GB")
    offload = tmp_path / "offload"
    model = meta_net()
    device_map = {"": "cpu", "layers.2": "disk"}
    load_checkpoint_in_model(
        model, checkpoint, device_map=device_map, offload_folder=offload, dtype=torch.float16
    )
    files = sorted(os.listdir(offload))
    assert files == ["index.json", "layers.2.0.bias.dat", "layers.2.0.weight.dat"]
    index = json.loads((offload / "index.json").read_text())
    assert index["layers.2.0.weight"] == {"dtype": "float16", "shape": [8, 8]}
    assert (
        model.layers[2][0].weight.dtype == torch.float16 and model.layers[2][0].weight.device.type == "meta"
    )
    assert not any(name.startswith(".") for name in os.listdir(offload))


def test_dtype_and_keep_in_fp32_modules(tmp_path) -> None:
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(make_net()), "file-safetensors", "1GB")
    model = meta_net()
    load_checkpoint_in_model(model, checkpoint, dtype="float16", keep_in_fp32_modules=["norm"])
    assert model.layers[0][0].weight.dtype == torch.float16
    assert model.norm.weight.dtype == torch.float32 and model.norm.running_mean.dtype == torch.float32
    assert model.norm.num_batches_tracked.dtype == torch.int64  # integers are never cast


def test_offload_state_dict_round_trip(tmp_path, monkeypatch) -> None:
    original = make_net()
    # A legacy (non-zip) .bin cannot be memory-mapped, so its CPU weights are spilled to a temporary folder.
    path = tmp_path / "legacy.bin"
    torch.save(_state(original), path, _use_new_zipfile_serialization=False)
    import tempfile

    spills: list[str] = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: spills.append(real_mkdtemp(**kw)) or spills[-1])
    from notebook_accel.utils.checkpoint_io import checkpoints

    written: list[str] = []
    real_offload_weight = checkpoints.offload_weight
    monkeypatch.setattr(
        checkpoints,
        "offload_weight",
        lambda w, n, *a, **k: written.append(n) or real_offload_weight(w, n, *a, **k),
    )
    model = meta_net()
    load_checkpoint_in_model(model, path, device_map={"": "cpu"}, offload_state_dict=True)
    torch.testing.assert_close(model(IDS), original(IDS))
    assert "layers.0.0.weight" in written  # spilled, then read back
    assert spills and not os.path.exists(spills[0])  # the temporary folder is gone
    written.clear()
    # memory-mapped checkpoints load the same with the flag on
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), "folder-bin", "700B")
    model = meta_net()
    load_checkpoint_in_model(model, checkpoint, device_map={"": "cpu"}, offload_state_dict=True)
    torch.testing.assert_close(model(IDS), original(IDS))
    assert written == []  # memory-mapped: nothing to spill


def test_strict_reports_missing_and_unexpected(tmp_path, caplog) -> None:
    state = _state(make_net())
    state.pop("layers.1.0.bias")
    state["extra.weight"] = torch.zeros(2)
    checkpoint = save_checkpoint(tmp_path / "ckpt", state, "file-safetensors", "1GB")
    with pytest.raises(
        RuntimeError, match=r"Missing key\(s\): layers\.1\.0\.bias.*Unexpected key\(s\): extra\.weight"
    ):
        load_checkpoint_in_model(meta_net(), checkpoint, strict=True)
    with caplog.at_level("WARNING"):
        load_checkpoint_in_model(make_net(), checkpoint)
    assert "layers.1.0.bias" in caplog.text and "extra.weight" in caplog.text


def test_errors_name_the_way_out(tmp_path) -> None:
    original = make_net()
    folder = tmp_path / "ckpt"
    checkpoint = save_checkpoint(folder, _state(original), "index-safetensors")
    with pytest.raises(ValueError, match="'disk'.*pass `offload_folder`"):
        load_checkpoint_in_model(meta_net(), checkpoint, device_map={"": "cpu", "layers": "disk"})
    # A key naming nothing in the model is ignored with 1.15's warning (ours adds the closest names).
    with pytest.warns(
        UserWarning,
        match=r"do not match any submodules in the model: \['layer'\]\nClosest names: 'layer': 'layers",
    ):
        load_checkpoint_in_model(meta_net(), checkpoint, device_map={"": "cpu", "layer": "cpu"})
    shard = json.loads(open(checkpoint).read())["weight_map"]["norm.weight"]
    os.remove(folder / shard)
    with pytest.raises(
        FileNotFoundError, match=f"Shard file .*{shard}.*named by the index .*{SAFE_WEIGHTS_INDEX_NAME}"
    ):
        load_checkpoint_in_model(meta_net(), checkpoint)
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        load_checkpoint_in_model(meta_net(), tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="not a folder containing a `.index.json` file"):
        load_checkpoint_in_model(meta_net(), empty)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.index.json").write_text("{}")
    (two / "b.index.json").write_text("{}")
    with pytest.raises(ValueError, match="more than one `.index.json`"):
        find_checkpoint_files(two)
    bad_index = tmp_path / "bad.index.json"
    bad_index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no 'weight_map'"):
        find_checkpoint_files(bad_index)
    garbage = tmp_path / "garbage.index.json"
    garbage.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        find_checkpoint_files(garbage)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_state_dict(tmp_path / "missing.safetensors")


def test_shape_mismatch_names_tensor_and_shapes(tmp_path) -> None:
    state = _state(make_net())
    state["layers.0.0.weight"] = torch.zeros(4, 8)
    checkpoint = save_checkpoint(tmp_path / "ckpt", state, "file-safetensors", "1GB")
    with pytest.raises(
        ValueError,
        match=r"shape torch.Size\(\[4, 8\]\) in \"weight\" \(which has shape torch.Size\(\[8, 8\]\)\), this looks "
        r"incorrect\.\n'layers\.0\.0\.weight' of Net has shape \(8, 8\), the value \(4, 8\)",
    ):
        load_checkpoint_in_model(meta_net(), checkpoint)
    with pytest.raises(
        ValueError, match=r"'layers\.0\.0\.weight' of Net has shape \(8, 8\), the value \(4, 8\)"
    ):
        load_checkpoint_in_model(
            meta_net(), checkpoint, device_map={"": "cpu", "layers": "disk"}, offload_folder=tmp_path / "o"
        )


def test_non_pt_safetensors_and_bnb_errors(tmp_path) -> None:
    path = tmp_path / "tf.safetensors"
    save_file({"a": torch.zeros(2)}, str(path), metadata={"format": "tf"})
    with pytest.raises(ValueError, match="holds 'tf' weights"):
        load_state_dict(path)
    save_file({"a": torch.zeros(2)}, str(path), metadata={"format": "weird"})
    with pytest.raises(OSError, match="unknown format metadata 'weird'"):
        load_state_dict(path)
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ImportError, match="pip install bitsandbytes"):
            load_checkpoint_in_model(meta_net(), path, offload_8bit_bnb=True)


def test_broadcast_from_rank0_needs_process_group(tmp_path) -> None:
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(make_net()), "file-safetensors", "1GB")
    with pytest.raises(ValueError, match="initialised process group"):
        load_checkpoint_in_model(make_net(), checkpoint, broadcast_from_rank0=True)


def _broadcast_worker(path: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(100 + dist.get_rank())  # ranks start from different weights
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        # only rank 0 reads the checkpoint: the path other ranks pass does not even exist
        checkpoint = path if dist.get_rank() == 0 else path + ".not-there"
        load_checkpoint_in_model(model, checkpoint, broadcast_from_rank0=True)
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()


def test_broadcast_from_rank0_two_ranks(tmp_path) -> None:
    from tests._dist import run_distributed

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    path = str(tmp_path / "model.safetensors")
    save_file(reference.state_dict(), path)
    results = run_distributed(_broadcast_worker, nprocs=2, args=(path,))
    for state in results:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value)


def test_get_state_dict_offloaded_model_reads_offloaded_weights() -> None:
    from notebook_accel.big_modeling import cpu_offload
    from notebook_accel.utils.modeling import get_state_dict_offloaded_model

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_offload(model, execution_device="cpu")
    assert model[0].weight.device.type == "meta"
    state = get_state_dict_offloaded_model(model)
    assert sorted(state) == sorted(reference)
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_safetensors_loads_straight_to_gpu(tmp_path) -> None:
    original = make_net()
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), "file-safetensors", "1GB")
    loaded = load_state_dict(checkpoint, device_map={"": 0, "layers": "cpu", "norm": "disk"})
    assert loaded["embed.weight"].device == torch.device("cuda", 0)
    assert loaded["layers.0.0.weight"].device.type == "cpu" and "norm.weight" not in loaded
    model = meta_net()
    load_checkpoint_in_model(model, checkpoint, device_map={"": 0})
    assert model.head.weight.device == torch.device("cuda", 0) and model.head.weight is model.embed.weight
    torch.testing.assert_close(model(IDS.cuda()).cpu(), original(IDS))


def test_failed_load_leaves_no_offload_files(tmp_path) -> None:
    state = _state(make_net())
    state["norm.weight"] = torch.zeros(3)  # wrong shape, in the last shard
    checkpoint = save_checkpoint(tmp_path / "ckpt", state, "index-bin", "700B")
    offload = tmp_path / "offload"
    with pytest.raises(ValueError, match=r"'norm\.weight'"):
        load_checkpoint_in_model(meta_net(), checkpoint, device_map={"": "disk"}, offload_folder=offload)
    assert not offload.exists() or os.listdir(offload) == []


def test_disk_entries_with_dtype_still_point_into_safetensors(tmp_path) -> None:
    original = make_net()
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), "file-safetensors", "1GB")
    offload = tmp_path / "offload"
    model = meta_net()
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map={"": "cpu", "layers": "disk"},
        offload_folder=offload,
        dtype=torch.bfloat16,
    )
    assert sorted(os.listdir(offload)) == ["index.json"]
    index = json.loads((offload / "index.json").read_text())
    assert index["layers.0.0.weight"]["dtype"] == "bfloat16"
    assert model.layers[0][0].weight.dtype == torch.bfloat16 and model.embed.weight.dtype == torch.bfloat16
    from notebook_accel.utils import OffloadedWeightsLoader

    value = OffloadedWeightsLoader(save_folder=offload)["layers.0.0.weight"]
    assert value.dtype == torch.bfloat16
    torch.testing.assert_close(value, original.layers[0][0].weight.to(torch.bfloat16))


def test_without_device_map_existing_parameters_keep_identity(tmp_path) -> None:
    original = make_net()
    checkpoint = save_checkpoint(tmp_path / "ckpt", _state(original), "file-safetensors", "1GB")
    model = make_net(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [id(p) for p in model.parameters()]
    load_checkpoint_in_model(model, checkpoint)
    assert [id(p) for p in model.parameters()] == before
    assert optimizer.param_groups[0]["params"][0] is model.embed.weight
    torch.testing.assert_close(model(IDS), original(IDS))


def test_rare_errors(tmp_path) -> None:
    not_a_dict = tmp_path / "list.bin"
    torch.save([torch.zeros(2)], not_a_dict)
    with pytest.raises(ValueError, match="holds a list, not a state dict"):
        load_state_dict(not_a_dict)

    class WithCache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("cache", torch.zeros(2), persistent=False)

    path = tmp_path / "cache.safetensors"
    save_file({"lin.weight": torch.ones(2, 2), "lin.bias": torch.ones(2), "cache": torch.ones(2)}, str(path))
    with pytest.raises(ValueError, match="cache has no device in the device_map"):
        load_checkpoint_in_model(WithCache(), path, device_map={"lin": "cpu"})

    from notebook_accel.utils.modeling import get_state_dict_offloaded_model

    with torch.device("meta"):
        empty = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="weight is on the meta device and has no offloaded copy"):
        get_state_dict_offloaded_model(empty)
