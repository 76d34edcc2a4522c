"""notebook_accel.big_modeling: empty init, CPU/disk offload, dispatch, checkpoint loading, prefetch."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from notebook_accel import telemetry
from notebook_accel.big_modeling import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from notebook_accel.hooks import (
    AlignDevicesHook,
    UserCpuOffloadHook,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from notebook_accel.hooks.offloaded import find_align_hook
from notebook_accel.prefetch import THREAD_NAME_PREFIX, Prefetcher, enable_prefetch
from notebook_accel.utils.checkpoint_io.checkpoints import load_checkpoint_in_model
from notebook_accel.utils.device_planning import placement
from notebook_accel.utils.device_planning.device_map import check_device_map
from notebook_accel.utils.device_planning.placement import DevicePlacement


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x).relu()) + x


class Net(nn.Module):
    """Embedding tied to the head, a BatchNorm (buffers), nested ModuleLists of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.stages = nn.ModuleList([nn.ModuleList([Block(), Block()]) for _ in range(2)])
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.head(self.bn(x))


def _prefetchers(model: nn.Module) -> list[Prefetcher]:
    found = []
    for module in model.modules():
        hook = find_align_hook(module)
        if hook is not None and hook._prefetcher is not None and hook._prefetcher not in found:
            found.append(hook._prefetcher)
    return found


def _unhook_and_check_threads(model: nn.Module) -> None:
    """Remove every hook; the prefetch worker threads of the model must be joined."""
    prefetchers = _prefetchers(model)
    _unhook(model)
    for prefetcher in prefetchers:
        assert prefetcher.closed and not prefetcher.alive_threads
        assert all(t.name.startswith(THREAD_NAME_PREFIX) for t in prefetcher._threads)


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    model = Net().eval()
    model.bn.running_mean.uniform_()
    return model


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 10, (4,))


def _unhook(model: nn.Module) -> None:
    remove_hook_from_submodules(model)
    remove_hook_from_module(model)


# -- init ----------------------------------------------------------------------------------------
def test_init_empty_weights() -> None:
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(10_000, 10_000), nn.BatchNorm1d(4))
    assert model[0].weight.device.type == "meta" and isinstance(model[0].weight, nn.Parameter)
    assert model[1].running_mean.device.type == "cpu"
    with init_empty_weights(include_buffers=True):
        model = nn.BatchNorm1d(4)
    assert model.running_mean.device.type == "meta"
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # patch undone


def test_init_empty_weights_env_default(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "1")
    with init_empty_weights():
        model = nn.BatchNorm1d(4)
    assert model.running_mean.device.type == "meta"
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "maybe")
    with pytest.raises(ValueError, match="ACCELERATE_INIT_INCLUDE_BUFFERS='maybe' is not a flag"):
        with init_empty_weights():
            pass


def test_init_on_device_keeps_requires_grad() -> None:
    with init_on_device("meta"):
        lin = nn.Linear(2, 2)
        lin.weight.requires_grad_(False)
        lin.extra = nn.Parameter(torch.ones(1), requires_grad=False)
    assert (
        lin.weight.device.type == "meta" and lin.extra.device.type == "meta" and not lin.extra.requires_grad
    )


# -- cpu / disk offload --------------------------------------------------------------------------
def test_cpu_offload_matches_plain(net: Net, ids) -> None:
    expected = net(ids)
    model = cpu_offload(copy.deepcopy(net))
    assert model.stages[0][0].fc.weight.device.type == "meta"
    assert torch.allclose(model(ids), expected)
    assert torch.allclose(model(ids), expected)
    _unhook_and_check_threads(model)
    assert torch.allclose(model(ids), expected)


def test_cpu_offload_options(net: Net, ids) -> None:
    expected = net(ids)
    model = cpu_offload(
        copy.deepcopy(net),
        execution_device="cpu",
        offload_buffers=True,
        state_dict=net.state_dict(),
        preload_module_classes=["Block"],
        prefetch=False,
    )
    assert model.bn.running_mean.device.type == "meta"
    assert find_align_hook(model.stages[0][0]).place_submodules
    assert not hasattr(model.stages[0][0].fc, "_hf_hook")
    assert torch.allclose(model(ids), expected)
    assert not _prefetchers(model)  # prefetch=False


def test_cpu_offload_root_with_own_weights(tmp_path) -> None:
    from notebook_accel.utils import has_offloaded_params

    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    expected = lin(x)
    disk_offload(lin, tmp_path)
    assert has_offloaded_params(lin) and lin.weight.device.type == "meta"
    assert len(_prefetchers(lin)) == 1
    assert torch.allclose(lin(x), expected) and torch.allclose(lin(x), expected)
    assert telemetry.weight_placement(lin)[""]["storage"] == "disk"
    # Zero copy on the CPU: the weight used by the forward is the memory-mapped view itself.
    hook = find_align_hook(lin)
    hook._load(lin)
    assert lin.weight.data_ptr() == hook.weights_map.dataset._mapped["weight"].data_ptr()
    hook._offload(lin)
    _unhook_and_check_threads(lin)
    assert torch.allclose(lin(x), expected)


def test_disk_offload_matches_plain_and_reuses_folder(net: Net, ids, tmp_path) -> None:
    expected = net(ids)
    model = disk_offload(copy.deepcopy(net), tmp_path)
    assert (tmp_path / "index.json").exists() and (tmp_path / "stages.0.0.fc.weight.dat").exists()
    assert torch.allclose(model(ids), expected)
    placement = telemetry.weight_placement(model)
    assert placement["stages.0.0.fc"]["storage"] == "disk"
    _unhook(model)
    assert torch.allclose(model(ids), expected)
    # A folder that already holds an index is read as it is, even into an empty model.
    with init_empty_weights():
        empty = Net().eval()
    empty.bn.running_var.fill_(1.0)
    empty.bn.running_mean.copy_(net.bn.running_mean)
    model = disk_offload(empty, tmp_path, execution_device="cpu")
    assert torch.allclose(model(ids), expected)
    _unhook_and_check_threads(model)


def test_disk_offload_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="disk_offload needs `offload_dir`"):
        disk_offload(nn.Linear(2, 2), None)
    with init_empty_weights():
        empty = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device .* Load a checkpoint first"):
        disk_offload(empty, tmp_path)
    assert os.listdir(tmp_path) == []


def test_cpu_offload_with_hook_chaining() -> None:
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    a, hook_a = cpu_offload_with_hook(a, "cpu")
    b, hook_b = cpu_offload_with_hook(b, "cpu", prev_module_hook=hook_a)
    assert isinstance(hook_a, UserCpuOffloadHook) and hook_b.hook.prev_module_hook is hook_a
    x = torch.randn(1, 2)
    assert torch.allclose(b(a(x)), b._old_forward(a._old_forward(x)))
    hook_b.offload()
    hook_b.remove()
    assert not hasattr(b, "_hf_hook")
    with pytest.raises(TypeError, match="prev_module_hook must be the UserCpuOffloadHook"):
        cpu_offload_with_hook(c, "cpu", prev_module_hook=object())


# -- dispatch ------------------------------------------------------------------------------------
DEVICE_MAP = {
    "embed": "cpu",
    "stages.0": "disk",
    "stages.1.0": "cpu",
    "stages.1.1": "disk",
    "bn": "cpu",
    "head": "cpu",
}


def test_dispatch_model_cpu_and_disk(net: Net, ids, tmp_path) -> None:
    expected = net(ids)
    model = dispatch_model(copy.deepcopy(net), DEVICE_MAP, offload_dir=tmp_path)
    assert model.hf_device_map == DEVICE_MAP
    assert model.stages[0][1].fc.weight.device.type == "meta"
    assert model.stages[1][0].fc.weight.device.type == "cpu"
    assert model.head.weight is model.embed.weight  # tied weights kept tied
    for _ in range(3):  # later forwards are served by the prefetcher
        assert torch.allclose(model(ids), expected)
    prefetcher = model.stages[0][0].fc._hf_hook._prefetcher
    assert isinstance(prefetcher, Prefetcher) and prefetcher.hits > 0  # pages faulted in ahead
    with pytest.raises(RuntimeError, match="offloaded to the CPU or disk .* remove its hooks first"):
        model.to("cpu")
    assert model.to(torch.float32) is model  # no device move: allowed
    _unhook_and_check_threads(model)
    assert prefetcher.closed and prefetcher._threads
    assert model.stages[0][1].fc.weight.device.type == "cpu"
    assert torch.allclose(model(ids), expected)
    assert "to" not in model.__dict__ and model.to("cpu") is model


def test_dispatch_model_whole_model_on_disk(net: Net, ids, tmp_path) -> None:
    expected = net(ids)
    model = dispatch_model(copy.deepcopy(net), {"": "disk"}, offload_dir=tmp_path)
    assert model.embed.weight.device.type == "meta"
    assert torch.allclose(model(ids), expected)
    _unhook(model)
    assert torch.allclose(model(ids), expected)


def test_dispatch_model_single_device_and_force_hooks(net: Net, ids) -> None:
    expected = net(ids)
    model = dispatch_model(copy.deepcopy(net), {"": "cpu"})
    assert not hasattr(model, "_hf_hook") and model.hf_device_map == {"": "cpu"}
    model = dispatch_model(copy.deepcopy(net), {"": torch.device("cpu")}, force_hooks=True, skip_keys=["x"])
    assert isinstance(model._hf_hook, AlignDevicesHook) and model._hf_hook.skip_keys == ["x"]
    assert torch.allclose(model(ids), expected)


def test_dispatch_model_with_state_dict_and_index(net: Net, ids, tmp_path) -> None:
    expected = net(ids)
    disk_offload(copy.deepcopy(net), tmp_path, prefetch=False)  # writes the folder
    import json

    index = json.loads((tmp_path / "index.json").read_text())
    with init_empty_weights():
        empty = Net().eval()
    empty.bn.running_mean.copy_(net.bn.running_mean)
    empty.bn.running_var.copy_(net.bn.running_var)
    model = dispatch_model(
        empty,
        {"": "disk"},
        main_device="cpu",
        offload_dir=tmp_path,
        offload_index=index,
        preload_module_classes=["Block"],
    )
    assert torch.allclose(model(ids), expected)


def test_dispatch_model_errors(net: Net, tmp_path) -> None:
    with pytest.raises(TypeError, match="needs a dict device_map"):
        dispatch_model(net, "auto")
    with pytest.raises(ValueError, match="empty device_map"):
        dispatch_model(net, {})
    with pytest.raises(ValueError, match="pass `offload_dir`"):
        dispatch_model(copy.deepcopy(net), DEVICE_MAP)
    with pytest.raises(ValueError, match="stages"):  # a device map that misses modules
        dispatch_model(copy.deepcopy(net), {"embed": "cpu"})
    with init_empty_weights():
        empty = Net().eval()
    with pytest.raises(ValueError, match="meta device"):
        dispatch_model(empty, {"": "disk"}, offload_dir=tmp_path / "off")
    assert not (tmp_path / "off").exists() or os.listdir(tmp_path / "off") == []


# -- load_checkpoint_and_dispatch ----------------------------------------------------------------
@pytest.fixture
def checkpoint(net: Net, tmp_path) -> str:
    sd = {k: v.contiguous() for k, v in net.state_dict().items() if k != "head.weight"}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return str(path)


STAGES_ON_DISK = {"embed": "cpu", "stages": "disk", "bn": "cpu", "head": "cpu"}


def _dispatched(checkpoint: str, **options) -> Net:
    """Return an empty-weights Net filled from ``checkpoint`` by ``load_checkpoint_and_dispatch(**options)``."""
    with init_empty_weights():
        model = Net().eval()
    return load_checkpoint_and_dispatch(model, checkpoint, **options)


@pytest.mark.parametrize(
    "device_map", [None, "auto", "balanced", "balanced_low_0", "sequential", {"": "cpu"}]
)
def test_load_checkpoint_and_dispatch_maps(net: Net, ids, checkpoint, device_map) -> None:
    expected = net(ids)
    model = _dispatched(checkpoint, device_map=device_map, no_split_module_classes=["Block"])
    assert torch.allclose(model(ids), expected)
    if device_map is not None:
        check_device_map(model, model.hf_device_map)  # every weight placed
    _unhook(model)


def test_load_checkpoint_and_dispatch_disk_copies_nothing(net: Net, ids, checkpoint, tmp_path) -> None:
    expected = net(ids)
    offload = tmp_path / "offload"
    model = _dispatched(
        checkpoint,
        device_map=STAGES_ON_DISK,
        offload_folder=offload,
    )
    assert os.listdir(offload) == ["index.json"]  # pointers into the safetensors file, no weight copied
    events: list = []
    with telemetry.subscribe(events.append):
        assert torch.allclose(model(ids), expected)
    loads = [e for e in events if e.kind == "load"]
    assert loads and all(e.source == "disk" for e in loads)
    assert {e.module for e in loads} >= {"stages.0.0.fc", "stages.1.1.norm"}


def test_load_checkpoint_and_dispatch_max_memory_to_disk(net: Net, ids, checkpoint, tmp_path) -> None:
    expected = net(ids)
    model = _dispatched(
        checkpoint,
        device_map="auto",
        max_memory={"cpu": 1200},
        offload_folder=tmp_path / "off",
        no_split_module_classes=["Block"],
    )
    assert "disk" in model.hf_device_map.values()
    assert torch.allclose(model(ids), expected)


def test_load_checkpoint_and_dispatch_options(net: Net, ids, checkpoint, tmp_path) -> None:
    expected = net(ids)
    model = _dispatched(
        checkpoint,
        device_map={"": "cpu"},
        dtype=torch.bfloat16,
        skip_keys=["labels"],
        preload_module_classes=["Block"],
        force_hooks=True,
        strict=True,
        offload_buffers=True,
    )
    assert model.stages[0][0].fc.weight.dtype == torch.bfloat16
    assert model._hf_hook.skip_keys == ["labels"]
    model = model.float()
    assert torch.allclose(model(ids), expected, atol=0.3)
    # dtype on weights read from disk: converted at each load, never cached converted.
    model = _dispatched(
        checkpoint,
        device_map=STAGES_ON_DISK,
        offload_folder=tmp_path / "off",
        dtype="float16",
        offload_state_dict=False,
        prefetch=False,
    )
    hook = find_align_hook(model.stages[0][0].fc)
    hook._load(model.stages[0][0].fc)
    assert model.stages[0][0].fc.weight.dtype == torch.float16
    hook._offload(model.stages[0][0].fc)
    loader = hook.weights_map.dataset
    assert all(t.dtype == torch.float32 for t in loader._mapped.values())  # the mapped views, not copies


def test_load_checkpoint_and_dispatch_errors(net: Net, checkpoint) -> None:
    with init_empty_weights():
        model = Net()
    with pytest.raises(
        ValueError,
        match=r"device_map='fastest' is not a device-map strategy.*'auto'.*, or a dict of module name -> device",
    ):
        load_checkpoint_and_dispatch(model, checkpoint, device_map="fastest")
    with pytest.raises(TypeError, match="device_map must be a dict"):
        load_checkpoint_and_dispatch(model, checkpoint, device_map=["cpu"])
    with pytest.raises(ValueError, match="pass `offload_folder`"):
        load_checkpoint_and_dispatch(model, checkpoint, device_map={"": "disk"})


@pytest.mark.parametrize("device_map", ["auto", {"": "cpu"}, DEVICE_MAP])
def test_load_checkpoint_and_dispatch_checks_the_map_once(
    net: Net, ids, checkpoint, tmp_path, monkeypatch, device_map
) -> None:
    calls: list[dict] = []
    real_check = placement.check_device_map
    monkeypatch.setattr(placement, "check_device_map", lambda m, dm: calls.append(dm) or real_check(m, dm))
    expected = net(ids)
    model = _dispatched(
        checkpoint,
        device_map=device_map,
        offload_folder=tmp_path / "off",
        no_split_module_classes=["Block"],
    )
    assert len(calls) == 1  # not again in load_checkpoint_in_model nor in dispatch_model
    assert torch.allclose(model(ids), expected)
    _unhook(model)


def test_device_placement_is_checked_again_for_another_model(net: Net) -> None:
    checked = DevicePlacement.check(net, {"": "cpu"})
    assert DevicePlacement.check(net, checked) is checked and checked.is_for(net)
    other = nn.Linear(2, 2)
    assert not checked.is_for(other)
    again = DevicePlacement.check(other, checked)  # a placement of another model is checked, not trusted
    assert again is not checked and again.is_for(other)
    # As 1.15: a key naming nothing in the model warns; the tensors it leaves without a device raise.
    with pytest.warns(UserWarning, match=r"do not match any submodules.*\['embed'\]"):
        with pytest.raises(
            ValueError, match="does not give any device for the following parameters: weight, bias"
        ):
            DevicePlacement.check(other, {"embed": "cpu"})
    # Checked for `net`, the map is checked again for `other`: "" covers it, "embed" names nothing there.
    with pytest.warns(UserWarning, match=r"do not match any submodules.*\['embed'\]"):
        dispatch_model(other, DevicePlacement.check(net, {"": "cpu", "embed": "cpu"}))


def test_missing_offload_folder_is_one_message(net: Net) -> None:
    with pytest.raises(
        ValueError,
        match=r"sends \['stages.0', 'stages.1.1'\] to 'disk'.*pass `offload_dir`.* or `offload_index`",
    ):
        dispatch_model(copy.deepcopy(net), DEVICE_MAP)
    with pytest.raises(ValueError, match=r"sends \[''\] to 'disk'.*pass `offload_folder` \(a folder"):
        load_checkpoint_in_model(net, "unused", device_map={"": "disk"})


# -- prefetcher ----------------------------------------------------------------------------------
def _chain(n: int = 6) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(n)]).eval()


def test_prefetch_learns_order_and_copies_ahead(tmp_path) -> None:
    model = _chain()
    x = torch.randn(2, 16)
    expected = model(x)
    disk_offload(model, tmp_path, prefetch=2)
    hooks = [model[i][0]._hf_hook for i in range(6)]
    for hook in hooks:
        hook.zero_copy = False  # force real loads so the worker copies
    prefetcher = hooks[0]._prefetcher
    prefetcher.cpu_copies = True  # copy ahead on the CPU too
    assert prefetcher.depth == 2 and prefetcher.hooks == hooks
    events: list = []
    with telemetry.subscribe(events.append):
        assert torch.allclose(model(x), expected)
        assert torch.allclose(model(x), expected)
    assert prefetcher.hits >= 6
    assert any(e.kind == "load" and e.prefetched for e in events)
    # By default (CPU) the worker only faults pages in; the forward's thread copies.
    prefetcher.cpu_copies = False
    assert torch.allclose(model(x), expected)
    assert not any(isinstance(v, list) for v in [prefetcher.take(h) for h in hooks])
    assert len(prefetcher._pending) <= 2  # bounded: never more than `depth` blocks ahead
    prefetcher.close()
    prefetcher.close()
    assert not prefetcher.alive_threads and all(h._prefetcher is None for h in hooks)
    assert torch.allclose(model(x), expected)  # still runs, synchronously


def test_prefetch_survives_exceptions(tmp_path) -> None:
    model = _chain(3)
    x = torch.randn(2, 16)
    expected = model(x)
    disk_offload(model, tmp_path)
    for i in range(3):
        model[i][0]._hf_hook.zero_copy = False
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # shape error inside block 0
    assert torch.allclose(model(x), expected)
    # A load failing in the background is redone in the forward's thread, where it raises.
    hook = model[1][0]._hf_hook
    real = hook.weights_map
    hook.weights_map = {}
    with pytest.raises(KeyError):
        model(x)
    hook.weights_map = real
    hook._loaded = False
    model[0][0]._hf_hook._offload(model[0][0])
    assert torch.allclose(model(x), expected)
    _unhook_and_check_threads(model)


def test_enable_prefetch_and_errors() -> None:
    assert enable_prefetch(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        Prefetcher(depth=0)
    model = cpu_offload(_chain(2), prefetch=False)
    prefetcher = enable_prefetch(model)
    assert len(prefetcher.hooks) == 2
    again = enable_prefetch(model)  # moves the hooks; the old one closes
    assert prefetcher.closed and len(again.hooks) == 2
    again.close()
    with pytest.raises(RuntimeError, match="closed"):
        again.register(AlignDevicesHook())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetch_side_stream(tmp_path) -> None:
    model = _chain(4)
    x = torch.randn(2, 16)
    expected = model(x)
    disk_offload(model, tmp_path, execution_device="cuda:0")
    out = model(x.cuda())
    out = model(x.cuda())
    assert out.device.type == "cuda" and torch.allclose(out.cpu(), expected, atol=1e-5)
    assert model[0][0]._hf_hook._prefetcher.hits > 0
    _unhook_and_check_threads(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dispatch_cpu_offload(net: Net, ids) -> None:
    expected = net(ids)
    model = dispatch_model(copy.deepcopy(net), {"embed": 0, "stages": "cpu", "bn": 0, "head": 0})
    assert model.embed.weight.device.type == "cuda"
    out = model(ids)
    assert out.device.type == "cpu" and torch.allclose(out, expected, atol=1e-5)
