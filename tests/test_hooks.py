"""The hook protocol and the attach/remove helpers of notebook_accel.hooks."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from torch import nn

from notebook_accel.hooks import (
    AlignDevicesHook,
    CpuOffload,
    LayerwiseCastingHook,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    attach_layerwise_casting_hooks,
    remove_hook_from_module,
    remove_hook_from_submodules,
)


class Model(nn.Module):
    """Small model with params, a persistent and a non-persistent buffer, and nested ModuleLists."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4)]) for _ in range(2)])
        self.linear2 = nn.Linear(4, 5)
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)

    def forward(self, x: torch.Tensor, *, offset: float = 0.0) -> torch.Tensor:
        """Run the model."""
        x = self.batchnorm(self.linear1(x))
        for block in self.blocks:
            x = block[0](x).relu()
        return self.linear2(x) * self.scale + offset


class AddOne(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        return (args[0] + 1,) + args[1:], kwargs


class TimesTwo(ModelHook):
    def post_forward(self, module, output):
        return output * 2


class Recorder(ModelHook):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_hook(self, module):
        self.calls.append("init")
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.calls.append("pre")
        return args, kwargs

    def post_forward(self, module, output):
        self.calls.append("post")
        return output

    def detach_hook(self, module):
        self.calls.append("detach")
        return module


@pytest.fixture
def model() -> Model:
    torch.manual_seed(0)
    return Model().eval()


def test_model_hook_defaults_are_identity() -> None:
    hook, module = ModelHook(), nn.Linear(2, 2)
    assert hook.no_grad is False
    assert hook.init_hook(module) is module and hook.detach_hook(module) is module
    assert hook.pre_forward(module, 1, a=2) == ((1,), {"a": 2})
    assert hook.post_forward(module, 3) == 3


def test_add_and_remove_hook_restores_forward(model: Model) -> None:
    x = torch.randn(2, 3)
    expected = model(x)
    rec = Recorder()
    add_hook_to_module(model, rec)
    assert model._hf_hook is rec and "_old_forward" in model.__dict__
    assert torch.allclose(model(x), expected)
    assert rec.calls == ["init", "pre", "post"]
    # The wrapper keeps name, docstring and signature.
    assert model.forward.__name__ == "forward"
    assert model.forward.__doc__ == Model.forward.__doc__
    assert list(inspect.signature(model.forward).parameters) == ["x", "offset"]
    remove_hook_from_module(model)
    assert rec.calls[-1] == "detach"
    assert (
        "forward" not in model.__dict__
        and not hasattr(model, "_hf_hook")
        and not hasattr(model, "_old_forward")
    )
    assert model.forward.__func__ is Model.forward


def test_pre_and_post_forward_transform(model: Model) -> None:
    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    add_hook_to_module(lin, AddOne())
    assert torch.allclose(lin(x), lin._old_forward(x + 1))
    add_hook_to_module(lin, TimesTwo())  # replaces
    assert torch.allclose(lin(x), lin._old_forward(x) * 2)
    add_hook_to_module(lin, AddOne(), append=True)  # chains: TimesTwo then AddOne
    assert isinstance(lin._hf_hook, SequentialHook)
    assert torch.allclose(lin(x), lin._old_forward(x + 1) * 2)
    remove_hook_from_module(lin)
    assert torch.allclose(lin(x), nn.functional.linear(x, lin.weight, lin.bias))


def test_sequential_hook_order_and_no_grad() -> None:
    a, b = Recorder(), Recorder()
    seq = SequentialHook(a, b)
    lin = nn.Linear(2, 2)
    add_hook_to_module(lin, seq)
    lin(torch.randn(1, 2))
    assert a.calls == ["init", "pre", "post"] and b.calls == ["init", "pre", "post"]
    assert seq.no_grad is False

    class NoGrad(ModelHook):
        no_grad = True

    add_hook_to_module(lin, NoGrad(), append=True)
    out = lin(torch.randn(1, 2))
    assert not out.requires_grad
    remove_hook_from_module(lin)
    assert lin(torch.randn(1, 2)).requires_grad


def test_sequential_hook_rejects_non_hooks() -> None:
    with pytest.raises(TypeError, match="SequentialHook takes ModelHook"):
        SequentialHook(object())


def test_add_hook_errors() -> None:
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        add_hook_to_module(object(), ModelHook())
    with pytest.raises(TypeError, match="needs a ModelHook"):
        add_hook_to_module(nn.Linear(1, 1), object())


def test_hooked_model_deepcopies_and_pickles(model: Model) -> None:
    add_hook_to_module(model, AddOne())
    x = torch.randn(2, 3)
    clone = copy.deepcopy(model)
    assert clone.forward.args[0] is clone  # bound to the copy, not the original
    assert clone.forward.args[1] is clone._hf_hook is not model._hf_hook
    assert torch.allclose(clone(x), model(x))
    restored = pickle.loads(pickle.dumps(model))
    assert torch.allclose(restored(x), model(x))


def test_remove_recurse_and_submodules(model: Model) -> None:
    for m in model.modules():
        add_hook_to_module(m, ModelHook())
    remove_hook_from_submodules(model)
    assert hasattr(model, "_hf_hook")
    assert not any(hasattr(m, "_hf_hook") for m in list(model.modules())[1:])
    for m in model.modules():
        add_hook_to_module(m, ModelHook())
    remove_hook_from_module(model, recurse=True)
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())


def test_align_devices_hook_execution_device_and_io(model: Model) -> None:
    x = torch.randn(2, 3)
    expected = model(x)
    hook = AlignDevicesHook(execution_device="meta", io_same_device=True, place_submodules=True)
    with pytest.raises(ValueError, match="'disk' is not a device a tensor can live on or compute on"):
        AlignDevicesHook(execution_device="disk")
    add_hook_to_module(model, hook)
    assert all(p.device.type == "meta" for p in model.parameters())
    remove_hook_from_module(model)
    torch.manual_seed(0)
    model = Model().eval()
    add_hook_to_module(
        model, AlignDevicesHook(execution_device="cpu", io_same_device=True, place_submodules=True)
    )
    assert torch.allclose(model(x), expected)
    assert hook.execution_device == "meta"


def test_align_devices_hook_offload_and_detach(model: Model) -> None:
    x = torch.randn(2, 3)
    expected = model(x)
    hook = AlignDevicesHook(execution_device="cpu", offload=True, offload_buffers=True, place_submodules=True)
    add_hook_to_module(model, hook)
    assert model.linear1.weight.device.type == "meta" and model.batchnorm.running_mean.device.type == "meta"
    assert model.scale.device.type == "cpu"  # non-persistent buffers are never offloaded
    assert set(hook.weights_map) >= {"linear1.weight", "batchnorm.running_mean"}
    assert torch.allclose(model(x), expected)
    assert model.linear1.weight.device.type == "meta"
    remove_hook_from_module(model)
    assert model.linear1.weight.device.type == "cpu"
    assert torch.allclose(model(x), expected)


def test_align_devices_hook_weights_map_and_skip_keys() -> None:
    lin = nn.Linear(2, 2)
    weights = {"weight": torch.eye(2), "bias": torch.zeros(2)}
    hook = AlignDevicesHook(execution_device="cpu", offload=True, weights_map=weights, skip_keys="y")
    add_hook_to_module(lin, hook)
    x = torch.randn(3, 2)
    assert torch.allclose(lin(x), x)
    args, kwargs = hook.pre_forward(lin, x, y="keep")
    assert kwargs == {"y": "keep"}
    hook.post_forward(lin, None)
    with pytest.raises(ValueError, match="lacks"):
        add_hook_to_module(
            nn.Linear(2, 2), AlignDevicesHook("cpu", offload=True, weights_map={"weight": torch.eye(2)})
        )


def test_align_devices_hook_tied_params_map() -> None:
    shared = torch.randn(2, 2)
    tied: dict = {shared.data_ptr(): {}}
    lin = nn.Linear(2, 2, bias=False)
    hook = AlignDevicesHook("meta", offload=True, weights_map={"weight": shared}, tied_params_map=tied)
    add_hook_to_module(lin, hook)
    hook._load(lin)
    assert torch.device("meta") in tied[shared.data_ptr()]
    hook._offload(lin)
    assert tied[shared.data_ptr()] == {}


def test_meta_weights_without_offload_raise() -> None:
    with torch.device("meta"):
        lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device .* load its weights first"):
        add_hook_to_module(lin, AlignDevicesHook(execution_device="cpu"))


def test_attach_execution_device_hook(model: Model) -> None:
    attach_execution_device_hook(model, "cpu", preload_module_classes=["ModuleList"])
    assert isinstance(model._hf_hook, AlignDevicesHook)
    assert isinstance(model.linear1._hf_hook, AlignDevicesHook)
    assert not hasattr(model.blocks[0][0], "_hf_hook")  # under a preloaded class: not visited
    model(torch.randn(2, 3))


def test_attach_align_device_hook_offload_and_preload(model: Model) -> None:
    x = torch.randn(2, 3)
    expected = model(x)
    weights = dict(model.state_dict())
    attach_align_device_hook(
        model, "cpu", offload=True, weights_map=weights, preload_module_classes=["ModuleList"]
    )
    assert model.linear1._hf_hook.offload and model.linear1._hf_hook.module_name == "linear1"
    assert model.blocks._hf_hook.place_submodules  # one hook loads the whole ModuleList
    assert not hasattr(model.blocks[0][0], "_hf_hook")
    # ModuleList has no forward: load its weights the way a parent that indexes it would.
    model.blocks._hf_hook._load(model.blocks)
    assert torch.allclose(model(x), expected)
    model.blocks._hf_hook._offload(model.blocks)
    assert model.blocks[0][0].weight.device.type == "meta"
    remove_hook_from_submodules(model)
    assert torch.allclose(model(x), expected)


def test_attach_align_device_hook_on_blocks_dicts(model: Model) -> None:
    x = torch.randn(2, 3)
    expected = model(x)
    names = ["linear1", "batchnorm", "blocks", "linear2"]
    execution = dict.fromkeys(names, "cpu")
    offload = {"linear1": False, "batchnorm": True, "blocks": True, "linear2": False}
    attach_align_device_hook_on_blocks(
        model, execution_device=execution, offload=offload, weights_map=dict(model.state_dict())
    )
    assert model._hf_hook.io_same_device
    assert model.linear1._hf_hook.place_submodules and not model.linear1._hf_hook.offload
    assert model.blocks[1][0]._hf_hook.offload
    assert torch.allclose(model(x), expected)
    remove_hook_from_module(model, recurse=True)
    # Single device / single flag forms.
    attach_align_device_hook_on_blocks(model, execution_device="cpu", offload=False)
    assert model._hf_hook.place_submodules
    remove_hook_from_module(model)
    attach_align_device_hook_on_blocks(model, execution_device="cpu", offload=True)
    assert model.linear1._hf_hook.offload
    assert torch.allclose(model(x), expected)


def test_layerwise_casting_hook() -> None:
    lin = nn.Linear(4, 4)
    add_hook_to_module(lin, LayerwiseCastingHook(torch.bfloat16, torch.float32, non_blocking=False))
    assert lin.weight.dtype == torch.bfloat16
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    out = lin(torch.randn(2, 4))
    assert out.dtype == torch.float32 and lin.weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="storage_dtype must be a torch.dtype"):
        LayerwiseCastingHook("bf16", torch.float32, False)


def test_attach_layerwise_casting_hooks_skips(model: Model) -> None:
    attach_layerwise_casting_hooks(
        model,
        torch.bfloat16,
        torch.float32,
        skip_modules_pattern=("linear2",),
        skip_modules_classes=(nn.BatchNorm1d,),
    )
    assert model.linear1.weight.dtype == torch.bfloat16 and model.blocks[0][0].weight.dtype == torch.bfloat16
    assert model.linear2.weight.dtype == torch.float32 and model.batchnorm.weight.dtype == torch.float32
    assert model(torch.randn(2, 3)).dtype == torch.float32
    plain = nn.Linear(2, 2)
    attach_layerwise_casting_hooks(plain, torch.float16, torch.float32)
    assert isinstance(plain._hf_hook, LayerwiseCastingHook)


def test_cpu_offload_hook_and_user_hook() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    hook_a = CpuOffload("meta")
    add_hook_to_module(a, hook_a)
    user_a = UserCpuOffloadHook(a, hook_a)
    hook_b = CpuOffload("cpu", prev_module_hook=user_a)
    add_hook_to_module(b, hook_b)
    a._hf_hook.pre_forward(a, torch.zeros(1, 2))
    assert a.weight.device.type == "meta"
    # Running b offloads a back to the CPU (a meta tensor cannot be copied back: use real devices).
    a.to_empty(device="cpu")
    b(torch.zeros(1, 2))
    assert a.weight.device.type == "cpu"
    user_a.remove()
    assert not hasattr(a, "_hf_hook")


def test_on_blocks_preload_classes_matter_only_for_offloaded_blocks(model: Model) -> None:
    x = torch.randn(2, 3)
    expected = model(x)
    names = ["linear1", "batchnorm", "blocks.0", "blocks.1", "linear2"]
    execution = dict.fromkeys(names, "cpu")
    offload = {"linear1": False, "batchnorm": False, "blocks.0": True, "blocks.1": False, "linear2": False}
    attach_align_device_hook_on_blocks(
        model,
        execution_device=execution,
        offload=offload,
        weights_map=dict(model.state_dict()),
        preload_module_classes=["ModuleList"],
    )
    # Offloaded block of a preload class: one hook loads its whole subtree, nothing below it is hooked.
    assert model.blocks[0]._hf_hook.place_submodules and model.blocks[0]._hf_hook.offload
    assert not hasattr(model.blocks[0][0], "_hf_hook")
    # Kept block of the same class: placed whole, and its inner layers still move their inputs.
    assert model.blocks[1]._hf_hook.place_submodules and not model.blocks[1]._hf_hook.offload
    assert (
        isinstance(model.blocks[1][0]._hf_hook, AlignDevicesHook) and not model.blocks[1][0]._hf_hook.offload
    )
    # The model itself is no block: it only keeps inputs and outputs where the caller had them.
    assert model._hf_hook.io_same_device and not model._hf_hook.place_submodules
    model.blocks[0]._hf_hook._load(model.blocks[0])  # ModuleList has no forward: load as its parent would
    assert torch.allclose(model(x), expected)


def test_attach_align_device_hook_preloads_only_when_offloading(model: Model) -> None:
    attach_align_device_hook(model, "cpu", offload=False, preload_module_classes=["ModuleList"])
    # Nothing is loaded at a forward, so a preload class needs no hook of its own: its layers get theirs.
    assert not hasattr(model.blocks, "_hf_hook") and not hasattr(model.blocks[0], "_hf_hook")
    assert not model.blocks[0][0]._hf_hook.offload and not model.blocks[0][0]._hf_hook.place_submodules
    assert model(torch.randn(2, 3)).shape == (2, 5)


def test_replacing_keeps_the_old_hook_attached_state_and_appending_reinits_it() -> None:
    lin = nn.Linear(2, 2)
    first, second, third = Recorder(), Recorder(), Recorder()
    add_hook_to_module(lin, first)
    add_hook_to_module(lin, second)  # replaced: the old hook is not detached
    assert first.calls == ["init"] and second.calls == ["init"]
    add_hook_to_module(lin, third, append=True)  # chained: the current hook is detached, then both init
    assert second.calls == ["init", "detach", "init"] and third.calls == ["init"]
    assert lin._hf_hook.hooks == (second, third)
    lin(torch.randn(1, 2))
    assert second.calls[-2:] == ["pre", "post"] and third.calls[-2:] == ["pre", "post"]


def test_align_devices_hook_repr_lists_its_settings() -> None:
    hook = AlignDevicesHook(execution_device="cpu", io_same_device=True, skip_keys=["cache"])
    assert repr(hook) == (
        "AlignDevicesHook(execution_device=cpu, offload=False, io_same_device=True, offload_buffers=False, "
        "place_submodules=False, skip_keys=['cache'])"
    )
