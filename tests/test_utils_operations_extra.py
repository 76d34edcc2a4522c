"""Accelerate 1.15's smaller data operations: one-source copies, input padding, checks, nested tensors."""

from __future__ import annotations

import warnings

import pytest
import torch

from notebook_accel.state import PartialState
from notebook_accel.utils.operations import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    GatheredParameters,
    chained_operation,
    copy_tensor_to_devices,
    find_device,
    gather_tensor_shape,
    get_shape,
    pad_across_processes,
    pad_input_tensors,
    recursively_apply,
    send_to_device,
    verify_operation,
)
from tests._dist import run_distributed


def test_pad_input_tensors_pads_to_a_multiple_of_the_processes() -> None:
    assert pad_input_tensors(torch.zeros(3, 4, 4), 3, 4).shape == (4, 4, 4)  # the documented example
    assert pad_input_tensors(torch.arange(1, 6), 5, 2).tolist() == [1, 2, 3, 4, 5, 0]
    assert pad_input_tensors(torch.arange(1, 4), 3, 8).tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    out = pad_input_tensors({"x": torch.ones(2, 5), "n": 3}, 2, 4, dim=0)
    assert out["x"].shape == (4, 5) and out["x"][2:].abs().sum() == 0 and out["n"] == 3
    assert pad_input_tensors(torch.arange(4), 4, 2).tolist() == [0, 1, 2, 3]  # already divisible
    with pytest.raises(ValueError, match="num_processes must be a positive int, got 0"):
        pad_input_tensors(torch.ones(2), 2, 0)


def test_find_device_and_get_shape_walk_nested_structures() -> None:
    data = [1, {"a": torch.zeros(2, 3), "b": [torch.zeros(1)]}]
    assert find_device(data) == torch.device("cpu")
    assert find_device([1, "x", {"k": None}]) is None
    assert get_shape(data[1]) == {"a": [2, 3], "b": [[1]]}


def test_recursively_apply_keeps_container_types_and_skip_keys() -> None:
    from collections import OrderedDict

    data = OrderedDict(a=(torch.ones(1), [torch.ones(2)]), b="keep")
    out = recursively_apply(lambda t: t * 3, data)
    assert isinstance(out, OrderedDict) and isinstance(out["a"], tuple) and isinstance(out["a"][1], list)
    assert out["a"][1][0].tolist() == [3.0, 3.0] and out["b"] == "keep"
    marker = torch.ones(1)
    moved = send_to_device({"x": torch.ones(1), "skip": marker}, "meta", skip_keys="skip")
    assert moved["x"].device.type == "meta" and moved["skip"] is marker


def test_single_process_copy_and_shape() -> None:
    PartialState()
    t = torch.arange(6).view(2, 3)
    assert copy_tensor_to_devices(t) is t
    assert gather_tensor_shape(t).tolist() == [2, 3]
    with pytest.raises(
        ValueError, match=r"copy_tensor_to_devices: a single process must pass a tensor, got None"
    ):
        copy_tensor_to_devices(None)


def _copy_worker():
    state = PartialState()
    source = torch.arange(6, dtype=torch.float64).view(2, 3) if state.process_index == 1 else None
    copied = copy_tensor_to_devices(source)
    mask = torch.tensor([True, False]) if state.process_index == 0 else None
    shape = gather_tensor_shape(mask)
    both = torch.ones(1)
    try:
        copy_tensor_to_devices(both)
    except ValueError as error:
        refused = str(error)
    return copied.tolist(), str(copied.dtype), copy_tensor_to_devices(mask).tolist(), shape.tolist(), refused


def test_copy_tensor_to_devices_in_two_processes() -> None:
    results = run_distributed(_copy_worker, nprocs=2)
    for copied, dtype, mask, shape, refused in results:
        assert copied == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and dtype == "torch.float64"
        assert mask == [True, False] and shape == [2]
        assert "exactly one process must pass a tensor" in refused and "[0, 1]" in refused


def _verify_worker():
    state = PartialState()

    # A local function: only verify_operation's check can notice that the shapes differ.
    @chained_operation
    @verify_operation
    def total(tensor):
        return [tensor.sum().item()] * 2

    ok = total(torch.ones(2))
    try:
        total(torch.ones(2 + state.process_index))
    except DistributedOperationException as error:
        return ok, str(error), str(error.__cause__)
    return ok, None, None


def test_verify_and_chained_operation_name_the_failing_call() -> None:
    results = run_distributed(_verify_worker, nprocs=2, env={"ACCELERATE_DEBUG_MODE": "1"})
    for ok, message, cause in results:
        assert ok == [2.0, 2.0]
        assert (
            message is not None
            and "failed because the processes passed it mismatched inputs" in message
            and "total" in message
        )
        assert "Process 0" in cause and "Process 1" in cause


def _nested_worker():
    state = PartialState()
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    regular = torch.ones(1 + state.process_index)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pad_across_processes({"n": nested, "r": regular})
    return out["n"].is_nested, out["r"].tolist(), [w.category.__name__ for w in caught]


def test_pad_across_processes_leaves_nested_tensors_and_warns() -> None:
    results = run_distributed(_nested_worker, nprocs=2)
    assert results[0] == (True, [1.0, 0.0], ["CannotPadNestedTensorWarning"])
    assert results[1] == (True, [1.0, 1.0], ["CannotPadNestedTensorWarning"])
    assert issubclass(CannotPadNestedTensorWarning, UserWarning)


def test_gathered_parameters_is_a_no_op_without_zero3(monkeypatch) -> None:
    param = torch.nn.Parameter(torch.ones(2))
    with GatheredParameters([param], modifier_rank=0):
        param.data.mul_(2)
    assert param.tolist() == [2.0, 2.0]
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(ImportError):  # ZeRO-3 asks DeepSpeed, which is not installed here
        GatheredParameters([param])
