"""Data operations in one process: structure walking, device moves, conversions, single-process fast paths."""

from __future__ import annotations

import collections
import pickle
from collections import OrderedDict, defaultdict
from typing import NamedTuple

import pytest
import torch

from notebook_accel.state import PartialState
from notebook_accel.utils import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_outputs_to_fp32,
    convert_to_fp32,
    find_batch_size,
    gather,
    gather_object,
    get_data_structure,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    is_tensor_information,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)


class Pair(NamedTuple):
    first: object
    second: object


Legacy = collections.namedtuple("Legacy", ["a", "b"])


class Frozen(collections.abc.Mapping):
    """A read-only mapping whose constructor takes a dict."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_DEBUG_MODE"):
        monkeypatch.delenv(name, raising=False)
    PartialState._reset_state()


def _nested():
    dd = defaultdict(list)
    dd["t"] = torch.ones(2)
    return {
        "pair": Pair(torch.zeros(3), [torch.ones(1), "label"]),
        "legacy": Legacy(a=torch.tensor(1.0), b=3),
        "ordered": OrderedDict(x=torch.arange(2)),
        "default": dd,
        "frozen": Frozen({"y": torch.ones(1)}),
        "tuple": (torch.ones(1),),
    }


def test_recursively_apply_keeps_container_types():
    out = recursively_apply(lambda t: t + 1, _nested())
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].first, torch.ones(3))
    assert out["pair"].second[1] == "label"
    assert isinstance(out["legacy"], Legacy) and out["legacy"].b == 3 and out["legacy"].a.item() == 2.0
    assert isinstance(out["ordered"], OrderedDict) and out["ordered"]["x"].tolist() == [1, 2]
    assert isinstance(out["default"], defaultdict) and out["default"].default_factory is list
    assert isinstance(out["frozen"], Frozen) and out["frozen"]["y"].item() == 2.0
    assert isinstance(out["tuple"], tuple)


def test_recursively_apply_args_test_type_and_errors():
    assert recursively_apply(lambda t, k, scale: t * k * scale, [torch.ones(1)], 2, scale=3)[0].item() == 6.0
    assert recursively_apply(
        lambda s: s.upper(), {"a": "x", "b": 1}, test_type=lambda x: isinstance(x, str)
    ) == {
        "a": "X",
        "b": 1,
    }

    def double(t):
        return t * 2

    with pytest.raises(
        TypeError,
        match=r"^Unsupported types \(<class 'str'>\) passed to `double`\. Only nested list/tuple/dicts of objects that are valid for `is_torch_tensor`",
    ):
        recursively_apply(double, [torch.ones(1), "text"], error_on_other_type=True)


def test_honor_type():
    assert honor_type(Pair(1, 2), (x * 10 for x in (1, 2))) == Pair(10, 20)
    assert honor_type((1, 2), iter([3, 4])) == (3, 4)
    assert honor_type([1], iter([5])) == [5]


def test_send_to_device_and_skip_keys():
    data = {"a": torch.ones(2), "skip": torch.ones(1), "pair": Pair(torch.zeros(1), "text")}
    moved = send_to_device(data, "meta", skip_keys="skip")
    assert moved["a"].device.type == "meta" and moved["pair"].first.device.type == "meta"
    assert moved["skip"] is data["skip"] and moved["pair"].second == "text"
    moved = send_to_device(data, torch.device("meta"), skip_keys=["skip", "pair"])
    assert moved["pair"] is data["pair"]
    t = torch.ones(3)
    assert send_to_device(t, "cpu") is t  # already there: no copy

    class Batch:
        def __init__(self):
            self.moved_to = None

        def to(self, device):  # no non_blocking parameter
            self.moved_to = device
            return self

    assert send_to_device([Batch()], "cpu", non_blocking=True)[0].moved_to == "cpu"
    assert send_to_device([1, "x", None], "meta") == [1, "x", None]


def test_listify_and_convert_to_fp32():
    data = {"h": torch.tensor([1.5], dtype=torch.float16), "b": torch.tensor([[2.0]], dtype=torch.bfloat16)}
    data["i"] = torch.tensor([3])
    assert listify(data) == {"h": [1.5], "b": [[2.0]], "i": [3]}
    converted = convert_to_fp32(data)
    assert converted["h"].dtype == torch.float32 and converted["b"].dtype == torch.float32
    assert converted["i"] is data["i"]


def _half_forward(x):
    return {"logits": x.half(), "n": 1}


def test_convert_outputs_to_fp32():
    forward = convert_outputs_to_fp32(_half_forward)
    out = forward(torch.ones(2))
    assert out["logits"].dtype == torch.float32 and out["n"] == 1
    assert forward.__name__ == "_half_forward" and forward.__wrapped__ is _half_forward
    assert pickle.loads(pickle.dumps(forward))(torch.ones(1))["logits"].dtype == torch.float32
    with pytest.raises(TypeError, match="expects a callable forward, got int"):
        convert_outputs_to_fp32(3)


def test_slice_tensors_and_concatenate():
    data = {"a": torch.arange(6).reshape(3, 2), "b": [torch.arange(3)]}
    part = slice_tensors(data, slice(0, 2))
    assert part["a"].shape == (2, 2) and part["b"][0].tolist() == [0, 1]
    merged = concatenate([part, slice_tensors(data, slice(2, 3))])
    assert torch.equal(merged["a"], data["a"]) and merged["b"][0].tolist() == [0, 1, 2]
    wide = concatenate([Pair(torch.ones(1, 1), torch.zeros(1, 2))] * 2, dim=1)
    assert isinstance(wide, Pair) and wide.first.shape == (1, 2) and wide.second.shape == (1, 4)


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        ([], ValueError, "empty list"),
        (torch.ones(2), TypeError, "list or tuple of structures, got Tensor"),
        ([{"a": 1}, {"a": 2}], TypeError, r"^Can only concatenate tensors but got <class 'int'>"),
        ([[torch.ones(1)], [torch.ones(1), torch.ones(1)]], ValueError, r"different lengths \[1, 2\]"),
    ],
)
def test_concatenate_errors(data, error, match):
    with pytest.raises(error, match=match):
        concatenate(data)


def test_find_batch_size():
    assert find_batch_size({"x": [torch.ones(4, 2)], "y": torch.ones(7)}) == 4
    assert find_batch_size(Pair(torch.ones(5), None)) == 5
    assert ignorant_find_batch_size([]) is None and ignorant_find_batch_size("text") is None


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        ([], ValueError, "empty list"),
        ({}, ValueError, "empty dict"),
        (["text"], TypeError, "tensors, got str"),
        (torch.tensor(1.0), ValueError, "0-dim tensor"),
    ],
)
def test_find_batch_size_errors(data, error, match):
    with pytest.raises(error, match=match):
        find_batch_size(data)


def test_data_structure_round_trip():
    data = {"a": torch.ones(2, 3, dtype=torch.float16), "b": [torch.zeros(1, dtype=torch.int64)]}
    structure = get_data_structure(data)
    assert is_tensor_information(structure["a"]) and not is_tensor_information(data["a"])
    assert structure["a"].shape == (2, 3) and structure["b"][0].dtype == torch.int64
    fresh = initialize_tensors(structure)
    assert (
        fresh["a"].shape == (2, 3)
        and fresh["a"].dtype == torch.float16
        and fresh["b"][0].dtype == torch.int64
    )


def test_single_process_fast_paths_return_input():
    data = {"x": torch.ones(3), "y": [torch.zeros(2)]}
    assert gather(data) is data
    assert reduce(data) is data and reduce(data, "sum") is data and reduce(data, "none") is data
    assert broadcast(data) is data
    assert pad_across_processes(data, dim=1) is data
    objects = [1, {"a": 2}]
    assert (
        gather_object(objects) is objects and gather_object("x") == ["x"] and gather_object((1, 2)) == [1, 2]
    )
    assert broadcast_object_list(objects) is objects


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: reduce(torch.ones(1), "avg"),
            ValueError,
            r"Unknown reduction 'avg': use one of 'mean', 'sum', 'none', 'max', 'min'",
        ),
        (
            lambda: broadcast(torch.ones(1), from_process=1),
            ValueError,
            r"from_process=1 is not a process index.*\[0, 0\]",
        ),
        (lambda: broadcast(torch.ones(1), from_process="0"), ValueError, "from_process='0'"),
        (lambda: broadcast_object_list([1], from_process=-1), ValueError, "from_process=-1"),
        (lambda: broadcast_object_list((1,)), TypeError, "expects a list .*got tuple"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_distributed_operation_exception_is_a_runtime_error():
    assert issubclass(DistributedOperationException, RuntimeError)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_send_to_device_cuda_round_trip():
    data = {"x": torch.ones(4).pin_memory(), "y": [torch.arange(3)]}
    on_gpu = send_to_device(data, "cuda:0", non_blocking=True)
    assert on_gpu["x"].device == torch.device("cuda", 0) and on_gpu["y"][0].is_cuda
    assert PartialState().device == torch.device("cuda", 0)
    back = send_to_device(convert_to_fp32({"h": on_gpu["x"].half()}), "cpu")
    assert back["h"].dtype == torch.float32 and back["h"].device.type == "cpu"
