"""Accelerator and state answers that code written for Accelerate 1.15 relies on (issue 22).

Each expected value below was read off the real Accelerate 1.15 on the same input (run, not read).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from notebook_accel import Accelerator, cpu_offload, disk_offload
from notebook_accel.state import AcceleratorState, PartialState
from notebook_accel.utils import TorchDynamoPlugin, find_executable_batch_size


def _objects():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=2)
    return model, optimizer, scheduler, loader


def test_preparing_twice_registers_each_object_once_and_flags_it() -> None:
    acc = Accelerator()
    prepared = acc.prepare(*_objects())
    assert all(getattr(obj, "_is_accelerate_prepared", False) is True for obj in prepared)
    again = acc.prepare(*prepared)
    assert all(a is b for a, b in zip(again, prepared))
    assert acc.prepare_model(prepared[0]) is prepared[0]
    counts = [len(acc._models), len(acc._optimizers), len(acc._schedulers), len(acc._dataloaders)]
    assert counts == [1, 1, 1, 1]


def test_an_object_prepared_elsewhere_joins_a_new_accelerator_once() -> None:
    # A notebook cell re-run builds a new Accelerator around objects prepared by the last one.
    prepared = Accelerator().prepare(*_objects())
    acc = Accelerator()
    again = acc.prepare(*prepared)
    acc.prepare(*prepared)
    assert all(a is b for a, b in zip(again, prepared))
    counts = [len(acc._models), len(acc._optimizers), len(acc._schedulers), len(acc._dataloaders)]
    assert counts == [1, 1, 0, 1]  # as 1.15: a prepared scheduler is passed through, not registered


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_save_model_of_an_offloaded_model_writes_its_real_weights(offload: str, tmp_path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    if offload == "cpu":
        cpu_offload(model, execution_device="cpu")
    else:
        disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    assert model[0].weight.device.type == "meta"
    Accelerator().save_model(model, tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(written) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(written[key], value), key


@pytest.mark.parametrize("cls", [PartialState, AcceleratorState])
def test_reading_a_reset_state_says_what_happened_as_accelerate_does(cls) -> None:
    state = cls() if cls is PartialState else Accelerator().state
    cls._reset_state()
    name = cls.__name__
    with pytest.raises(
        AttributeError,
        match=rf"^`{name}` object has no attribute `device`\. This happens if `{name}\._reset_state\(\)` "
        r"was called and an `Accelerator` or `PartialState` was not reinitialized",
    ):
        _ = state.device


@pytest.mark.parametrize("device", ["cpu:64", "cpu:3", "meta"])
def test_accelerate_torch_device_is_kept_as_given(device: str, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", device)
    assert Accelerator().device == torch.device(device)
    assert PartialState().device == torch.device(device)


def test_a_bad_accelerate_torch_device_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "bogus:1")
    with pytest.raises(ValueError, match=r"ACCELERATE_TORCH_DEVICE='bogus:1' is not a torch device"):
        PartialState()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {}),
        ({"mode": "max-autotune"}, {"mode": "max-autotune"}),
        ({"backend": "eager", "fullgraph": True}, {"backend": "eager", "fullgraph": True}),
        ({"backend": "INDUCTOR", "mode": "default"}, {"backend": "inductor"}),
        ({"options": {"a": 1}}, {"options": {"a": 1}}),
        ({"dynamic": False}, {"dynamic": False}),
        ({"disable": True}, {"disable": True}),
        ({"use_regional_compilation": True}, {}),
        ({"fullgraph": False}, {}),
    ],
)
def test_dynamo_plugin_to_kwargs_gives_only_what_differs_from_defaults(kwargs, expected, monkeypatch) -> None:
    for name in ("BACKEND", "MODE", "USE_FULLGRAPH", "USE_DYNAMIC", "USE_REGIONAL_COMPILATION"):
        monkeypatch.delenv(f"ACCELERATE_DYNAMO_{name}", raising=False)
    assert TorchDynamoPlugin(**kwargs).to_kwargs() == expected


def test_dynamo_plugin_from_the_environment_is_not_a_default(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    assert TorchDynamoPlugin().to_kwargs() == {"backend": "inductor", "mode": "max-autotune"}


# Each message Accelerate 1.15 retries on (should_reduce_batch_size), and some it does not.
_RETRIED = [
    "CPU out of memory.",
    "CUDA out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
    "XPU out of memory.",
    "NPU out of memory.",
    "MLU out of memory.",
    "MPS backend out of memory",
    "HIP out of memory.",
    "SDAA out of memory.",
    "MUSA out of memory.",
]
_NOT_RETRIED = ["CUDA error: out of memory", "cpu out of memory", "out of memory", "HPU out of memory"]


@pytest.fixture
def collections(monkeypatch) -> list[int]:
    """Count the garbage collections asked for: each retry asks one (a real one takes seconds late in the suite)."""
    asked: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: asked.append(generation) or 0)
    return asked


@pytest.mark.parametrize("message", _RETRIED)
def test_find_executable_batch_size_retries_on_accelerates_oom_messages(message: str, collections) -> None:
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 8:
            raise RuntimeError(f"oops: {message} (tried to allocate)")
        return batch_size

    assert train() == 8
    assert tried == [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15, 13, 11, 9, 8]
    assert len(collections) == len(tried)  # memory freed before the first try and before each retry


@pytest.mark.parametrize("message", _NOT_RETRIED)
def test_find_executable_batch_size_lets_other_errors_through(message: str, collections) -> None:
    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        raise RuntimeError(message)

    with pytest.raises(RuntimeError, match=message):
        train()


@pytest.mark.parametrize("bits", ["is_loaded_in_8bit", "is_loaded_in_4bit"])
@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_a_quantized_model_offloaded_to_cpu_or_disk_is_refused(bits: str, where: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    setattr(model, bits, True)
    model.hf_device_map = {"0": 0, "1": where}
    with pytest.raises(
        ValueError, match=rf"8-bit or 4-bit precision with CPU or disk offload: .* on {where}"
    ):
        Accelerator().prepare(model)


def test_a_quantized_model_on_its_device_map_is_not_moved() -> None:
    class Unmovable(torch.nn.Linear):
        def to(self, *args, **kwargs):
            raise ValueError(".to is not supported for 8-bit models")

    model = Unmovable(2, 2)
    model.is_loaded_in_8bit, model.hf_device_map = True, {"": 0}
    assert Accelerator().prepare(model) is model
