"""Device-map helpers of Accelerate 1.15 (leaves, tied sizes, fallback allocation), offload reads, unwrapping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from notebook_accel.big_modeling import cpu_offload
from notebook_accel.state import PartialState
from notebook_accel.utils.device_planning import tensors as tensors_module
from notebook_accel.utils.grad_scaler import get_grad_scaler
from notebook_accel.utils.modeling import (
    check_device_same,
    check_tied_parameters_in_config,
    compute_module_sizes,
    fallback_allocate,
    get_module_leaves,
    get_module_size_with_ties,
    get_non_persistent_buffers,
    get_state_dict_from_offload,
    is_peft_model,
    set_module_tensor_to_device,
)
from notebook_accel.utils.other import extract_model_from_parallel
from notebook_accel.utils.tqdm import tqdm


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))


def test_get_module_leaves() -> None:
    sizes = {"": 10, "a": 4, "a.w": 4, "b": 6, "b.c": 6, "b.c.w": 3, "b.c.v": 3}
    assert get_module_leaves(sizes) == ["a.w", "b.c.w", "b.c.v"]


def test_get_module_size_with_ties_adds_the_tied_module_once() -> None:
    model = _model()
    sizes = compute_module_sizes(model)
    # "0" (24 bytes) tied to 1.0.weight: module "1" (52) joins it, the shared weight (24) counted once.
    size, names, modules = get_module_size_with_ties(
        ["1.0.weight"], 24, sizes, [("1", model[1]), ("0", model[0])]
    )
    assert (size, names, modules) == (52, ["1"], [model[1]])
    assert get_module_size_with_ties([], 24, sizes, [("1", model[1])]) == (24, [], [])
    # A tied parameter whose module was already placed adds nothing.
    assert get_module_size_with_ties(["9.weight"], 24, sizes, [("1", model[1])])[0] == 24


def test_fallback_allocate_searches_breadth_first() -> None:
    model = _model()
    sizes = compute_module_sizes(model)
    modules = list(model.named_children())
    name, module, rest = fallback_allocate(modules, sizes, 30)
    assert name == "0" and module is model[0] and [n for n, _ in rest] == ["1"]
    name, module, rest = fallback_allocate(modules, sizes, 20)
    assert name == "1.1" and module is model[1][1] and [n for n, _ in rest] == ["0", "1.0"]
    assert fallback_allocate(modules, sizes, 20, no_split_module_classes=["Sequential"])[0] is None
    assert fallback_allocate(modules, sizes, "20B")[0] == "1.1"
    assert fallback_allocate(modules, sizes, 10) == (None, None, modules)


def test_check_device_same_reads_bare_accelerator_as_index_zero() -> None:
    assert check_device_same(torch.device("cuda"), torch.device("cuda:0"))
    assert not check_device_same("cuda:1", "cuda")
    assert check_device_same("cpu", torch.device("cpu"))
    assert not check_device_same("cpu", "meta")


def test_get_non_persistent_buffers() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    model.register_buffer("cache", torch.ones(1), persistent=False)
    model[0].register_buffer("mask", torch.ones(1), persistent=False)
    model[0].register_buffer("kept", torch.ones(1))
    assert get_non_persistent_buffers(model) == {"cache"}
    assert get_non_persistent_buffers(model, recurse=True) == {"cache", "mask"}
    assert get_non_persistent_buffers(model, recurse=True, fqns=True) == {"cache", "0.mask"}


def test_check_tied_parameters_in_config() -> None:
    class Config:
        tie_word_embeddings = True
        is_encoder_decoder = False

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config, self.head = Config(), nn.Linear(2, 2)

        def get_output_embeddings(self):
            return self.head

    assert check_tied_parameters_in_config(LM())
    lm = LM()
    lm.config.tie_word_embeddings = False
    assert not check_tied_parameters_in_config(lm)
    assert not check_tied_parameters_in_config(_model())


def test_get_state_dict_from_offload_reads_offloaded_weights() -> None:
    PartialState()
    model = _model()
    expected = {k: v.clone() for k, v in model[1].state_dict().items()}
    cpu_offload(model, execution_device="cpu")
    assert model[1][0].weight.device.type == "meta"
    out = get_state_dict_from_offload(model[1], "1", {"keep": 1})
    assert out["keep"] == 1
    for key, value in expected.items():
        assert torch.equal(out[f"1.{key}"], value)
    assert model[1][0].weight.device.type == "meta"  # released again after the read
    with pytest.raises(ValueError, match=r"fresh.weight is on the meta device"):
        get_state_dict_from_offload(nn.Linear(1, 1, device="meta"), "fresh", {})


def test_set_module_tensor_to_device_clear_cache_only_for_accelerator_moves(monkeypatch) -> None:
    cleared = []
    monkeypatch.setattr(tensors_module, "clear_device_cache", lambda *a, **k: cleared.append(True))
    layer = nn.Linear(2, 2, device="meta")
    set_module_tensor_to_device(layer, "weight", "cpu", value=torch.ones(2, 2), non_blocking=True)
    assert layer.weight.device.type == "cpu" and layer.weight.sum() == 4 and cleared == []
    monkeypatch.setattr(tensors_module, "_ACCELERATOR_TYPES", frozenset({"cpu"}))  # pretend: CPU caches
    set_module_tensor_to_device(layer, "bias", "cpu", value=torch.ones(2))
    assert cleared == [True]
    set_module_tensor_to_device(layer, "bias", "cpu", value=torch.zeros(2), clear_cache=False)
    assert cleared == [True]


def test_extract_model_from_parallel_recursive_unwraps_children() -> None:
    class Wrapper(nn.Module):  # stands in for DDP: the test patches it into the wrapper list
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    import notebook_accel.utils.other as other

    model = nn.Sequential(Wrapper(nn.Linear(1, 1)), nn.Linear(1, 1))
    original = other._parallel_wrappers
    other._parallel_wrappers = lambda: (*original(), Wrapper)
    try:
        assert isinstance(extract_model_from_parallel(model)[0], Wrapper)
        out = extract_model_from_parallel(Wrapper(model), recursive=True)
    finally:
        other._parallel_wrappers = original
    assert out is model and isinstance(model[0], nn.Linear)


def test_get_grad_scaler_and_is_peft_model() -> None:
    scaler = get_grad_scaler(init_scale=1024.0)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._init_scale == 1024.0
    with pytest.raises(ValueError, match=r"distributed_type='GPUS' is not valid"):
        get_grad_scaler("GPUS")
    with pytest.raises(ImportError, match="needs torch_xla"):
        get_grad_scaler("XLA")
    assert not is_peft_model(_model())


def test_tqdm_shows_on_the_local_main_process_only(monkeypatch) -> None:
    PartialState()
    assert not tqdm(range(2)).disable
    assert tqdm(range(2), disable=True).disable
    monkeypatch.setitem(PartialState._shared_state, "local_process_index", 1)
    assert tqdm(range(2)).disable and not tqdm(range(2), main_process_only=False).disable
