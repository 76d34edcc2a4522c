"""Accelerate 1.15's Accelerator / state / optimizer / loader members (issue 12): run facts, LOMO, Ulysses,
load_state's load_kwargs, on_last_process, GradientState's dataloader properties, zero_grad(None), samplers."""

from __future__ import annotations

import inspect
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from notebook_accel import Accelerator
from notebook_accel.data_loader import prepare_data_loader
from notebook_accel.data_loader.loader_adapter import DataLoaderAdapter
from notebook_accel.optimizer import AcceleratedOptimizer
from notebook_accel.state import GradientState
from notebook_accel.utils import (
    AORecipeKwargs,
    DataLoaderConfiguration,
    DistributedType,
    FP8RecipeKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
)
from notebook_accel.utils.enums import FP8BackendType


def test_run_facts_of_a_single_process_accelerator() -> None:
    acc = Accelerator()
    assert acc.deepspeed_plugin is None
    assert acc.fp8_backend == FP8BackendType.NO
    assert acc.multi_device is False
    assert acc.should_save_model is True  # the local main process saves
    assert acc.use_stateful_dataloader is False


def test_use_stateful_dataloader_follows_the_dataloader_config() -> None:
    pytest.importorskip("torchdata")
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    assert acc.use_stateful_dataloader is True


@pytest.mark.parametrize(
    ("handler", "backend"),
    [(AORecipeKwargs(), FP8BackendType.AO), (TERecipeKwargs(), FP8BackendType.TE)],
)
def test_fp8_backend_is_the_recipe_handlers(handler, backend) -> None:
    assert Accelerator(kwargs_handlers=[handler]).fp8_backend == backend


def test_fp8_backend_msamp_from_handler_or_deepspeed_plugin() -> None:
    fget = Accelerator.fp8_backend.fget
    no_plugin = SimpleNamespace(deepspeed_plugin=None)
    msamp = MSAMPRecipeKwargs.__new__(MSAMPRecipeKwargs)  # the engine check needs ms-amp installed
    assert fget(SimpleNamespace(fp8_recipe_handler=msamp, state=no_plugin)) == FP8BackendType.MSAMP
    with pytest.warns(FutureWarning):
        combined = FP8RecipeKwargs(backend="MSAMP")  # names its backend, though it is also a TE recipe
    assert fget(SimpleNamespace(fp8_recipe_handler=combined, state=no_plugin)) == FP8BackendType.MSAMP
    plugin_state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(enable_msamp=True))
    assert fget(SimpleNamespace(fp8_recipe_handler=None, state=plugin_state)) == FP8BackendType.MSAMP
    plain_state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(enable_msamp=False))
    assert fget(SimpleNamespace(fp8_recipe_handler=None, state=plain_state)) == FP8BackendType.NO


def test_multi_device_means_several_accelerator_devices_not_cpu_processes() -> None:
    fget = Accelerator.multi_device.fget
    assert fget(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.MULTI_GPU)) is True
    assert fget(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.MULTI_XPU)) is True
    assert fget(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.MULTI_CPU)) is False
    assert fget(SimpleNamespace(use_distributed=True, distributed_type=DistributedType.FSDP)) is False
    assert fget(SimpleNamespace(use_distributed=False, distributed_type=DistributedType.MULTI_GPU)) is False


def test_should_save_model_every_rank_under_a_parallelism_config() -> None:
    fget = Accelerator.should_save_model.fget
    not_local_main = SimpleNamespace(is_local_main_process=False)
    assert fget(SimpleNamespace(parallelism_config=None, state=not_local_main)) is False
    assert fget(SimpleNamespace(parallelism_config=object(), state=not_local_main)) is True


def test_deepspeed_plugin_only_under_deepspeed() -> None:
    plugin = object()
    fget = Accelerator.deepspeed_plugin.fget
    ds = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugin=plugin)
    assert fget(SimpleNamespace(state=ds)) is plugin
    other = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, deepspeed_plugin=plugin)
    assert fget(SimpleNamespace(state=other)) is None


def test_trigger_sync_in_backward_is_static_and_leaves_plain_models_alone() -> None:
    assert list(inspect.signature(Accelerator.trigger_sync_in_backward).parameters) == ["model"]
    model = torch.nn.Linear(2, 1)
    with Accelerator.trigger_sync_in_backward(model):  # no instance needed, as in Accelerate 1.15
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None and not hasattr(model, "require_backward_grad_sync")


def _install_fake_lomo(monkeypatch) -> type:
    class Lomo(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})
            self.calls = []

        def fused_backward(self, loss, lr):
            self.calls.append(lr)
            loss.backward()
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p -= lr * p.grad
                        p.grad = None

    module = types.ModuleType("lomo_optim")
    module.Lomo, module.AdaLomo = Lomo, type("AdaLomo", (Lomo,), {})
    monkeypatch.setitem(sys.modules, "lomo_optim", module)
    return Lomo


def test_lomo_backward_runs_the_fused_update_of_the_prepared_lomo(monkeypatch) -> None:
    lomo_cls = _install_fake_lomo(monkeypatch)
    acc = Accelerator()
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    model, opt = acc.prepare(model, lomo_cls(model.parameters()))
    acc.lomo_backward(model(torch.ones(1, 1)).sum(), 0.25)
    assert opt.optimizer.calls == [0.25]
    assert model.weight.item() == pytest.approx(0.75)


def test_lomo_backward_refuses_without_a_lomo_optimizer(monkeypatch) -> None:
    _install_fake_lomo(monkeypatch)
    acc = Accelerator()
    model = torch.nn.Linear(1, 1)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(
        ValueError, match=r"no LOMO optimizer was prepared \(prepared optimizers: \['SGD'\]\)"
    ):
        acc.lomo_backward(model(torch.ones(1, 1)).sum(), 0.1)


def test_lomo_backward_checks_its_input_and_names_the_package(monkeypatch) -> None:
    acc = Accelerator()
    with pytest.raises(TypeError, match="loss must be a torch.Tensor, got float"):
        acc.lomo_backward(1.0, 0.1)
    with pytest.raises(ValueError, match="learning_rate must be a non-negative number, got -1"):
        acc.lomo_backward(torch.tensor(1.0), -1)
    monkeypatch.setitem(sys.modules, "lomo_optim", None)  # not installed
    with pytest.raises(ImportError, match="pip install lomo-optim"):
        acc.lomo_backward(torch.tensor(1.0), 0.1)


def test_ulysses_adapter_passes_loaders_through_without_sequence_parallelism(monkeypatch) -> None:
    acc = Accelerator()
    loader = DataLoader(list(range(4)))
    assert acc.deepspeed_ulysses_dl_adapter(loader, torch.nn.Linear(1, 1)) is loader
    adapter = Accelerator.deepspeed_ulysses_dl_adapter
    sp2 = SimpleNamespace(sp_size=2)
    not_ds = SimpleNamespace(parallelism_config=sp2, distributed_type=DistributedType.MULTI_CPU)
    with pytest.raises(ValueError, match="sp_size=2 needs DeepSpeed, but the distributed type is MULTI_CPU"):
        adapter(not_ds, loader, None)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    ds = SimpleNamespace(parallelism_config=sp2, distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ImportError, match="pip install deepspeed"):
        adapter(ds, loader, None)


def test_load_state_hands_load_kwargs_to_the_file_loader(tmp_path) -> None:
    acc = Accelerator()
    model = torch.nn.Linear(2, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    acc.save_state(tmp_path / "ckpt")
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    opt.optimizer.state.clear()
    with pytest.raises(ValueError, match="weights_only=True only"):
        acc.load_state(tmp_path / "ckpt", load_kwargs={"weights_only": False})
    acc.load_state(tmp_path / "ckpt", load_kwargs={"mmap": True})
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)


def test_on_last_process_needs_the_function() -> None:
    acc = Accelerator()
    ran = []
    assert acc.on_last_process(lambda: ran.append(1) or "done")() == "done" and ran == [1]
    with pytest.raises(TypeError, match="on_last_process needs a function to decorate, got None"):
        acc.on_last_process(None)
    with pytest.raises(TypeError):
        acc.on_last_process()  # no decorator-factory form in Accelerate 1.15


def test_gradient_state_dataloader_properties() -> None:
    state = GradientState()
    with pytest.raises(AttributeError):
        state.active_dataloader = object()  # read-only: it follows the references
    outer, inner = object(), object()
    state.dataloader_references = [None, outer, inner]
    assert state.active_dataloader is inner
    state.dataloader_references = []
    assert state.dataloader_references == [None] and state.active_dataloader is None


def test_zero_grad_none_uses_the_wrapped_optimizers_default() -> None:
    class KeepsZeros(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = False) -> None:
            super().zero_grad(set_to_none=set_to_none)

    for cls, expect_none in ((torch.optim.SGD, True), (KeepsZeros, False)):
        model = torch.nn.Linear(2, 1)
        opt = AcceleratedOptimizer(cls(model.parameters(), lr=0.1))
        model(torch.ones(1, 2)).sum().backward()
        opt.zero_grad()
        assert (model.weight.grad is None) is expect_none
        model(torch.ones(1, 2)).sum().backward()
        opt.zero_grad(set_to_none=False)
        assert torch.equal(model.weight.grad, torch.zeros_like(model.weight))


@pytest.mark.parametrize("dispatch", [False, True])
def test_get_and_set_sampler_of_prepared_loaders(dispatch) -> None:
    loader = prepare_data_loader(
        DataLoader(list(range(6)), batch_size=2, shuffle=True), dispatch_batches=dispatch, put_on_device=True
    )
    assert isinstance(loader.get_sampler(), RandomSampler)
    sequential = SequentialSampler(range(6))
    loader.set_sampler(sequential)
    assert loader.get_sampler() is sequential
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(TypeError, match="set_sampler needs a torch.utils.data.Sampler, got list"):
        loader.set_sampler([0, 1])


def test_adjust_state_dict_for_prefetch_acts_on_dl_state_dict() -> None:
    pytest.importorskip("torchdata")

    class ReadsOneAhead(DataLoaderAdapter):
        def adjust_state_dict_for_prefetch(self) -> None:
            self.dl_state_dict["_num_yielded"] -= 1

    assert list(inspect.signature(DataLoaderAdapter.adjust_state_dict_for_prefetch).parameters) == ["self"]
    plain = DataLoaderAdapter(list(range(6)), use_stateful_dataloader=True, batch_size=2)
    ahead = ReadsOneAhead(list(range(6)), use_stateful_dataloader=True, batch_size=2)
    for loader in (plain, ahead):
        it = iter(loader)
        next(it), next(it)
    assert plain.state_dict()["_num_yielded"] == 2 and plain.dl_state_dict["_num_yielded"] == 2
    assert ahead.state_dict()["_num_yielded"] == 1
