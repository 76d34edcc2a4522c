"""Operations as code written for Accelerate 1.15 meets them (issue 22).

The expected values were read off the real Accelerate 1.15 on the same inputs (run, not read);
where we answer otherwise on purpose (``reduction="min"``, unknown reductions) the test says so and
docs/guide/migrating.md lists it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from notebook_accel.utils import ParallelismConfig
from notebook_accel.utils.operations import (
    CannotPadNestedTensorWarning,
    concatenate,
    honor_type,
    pad_across_processes,
    recursively_apply,
    reduce,
)
from tests._dist import run_distributed


def _reduce_worker() -> dict:
    from notebook_accel.state import PartialState

    rank = PartialState(cpu=True).process_index
    out = {}
    for name in ("max", "min", "mean", "sum", "none"):
        t = torch.tensor([1.0 + rank, 5.0 - 3 * rank, 2.0])
        nested = reduce({"a": t, "b": [t.clone()]}, reduction=name, scale=2.0)
        ints = reduce(torch.tensor([1 + rank, 7 - 5 * rank]), reduction=name)
        out[name] = {
            "a": nested["a"].tolist(),
            "b": nested["b"][0].tolist(),
            "input": t.tolist(),
            "ints": ints.tolist(),
            "int_dtype": str(ints.dtype),
        }
    return out


def test_reductions_across_two_processes() -> None:
    ranks = run_distributed(_reduce_worker, nprocs=2, timeout=120)
    # rank 0 holds [1, 5, 2] and [1, 7], rank 1 holds [2, 2, 2] and [2, 2]
    for rank, got in enumerate(ranks):
        assert got["max"]["a"] == got["max"]["b"] == [2.0, 5.0, 2.0]  # as 1.15 (scale ignored off XLA)
        assert got["max"]["ints"] == [2, 7] and got["max"]["int_dtype"] == "torch.int64"
        assert got["min"]["a"] == got["min"]["b"] == [1.0, 2.0, 2.0]  # 1.15 sums here: see migrating.md
        assert got["min"]["ints"] == [1, 2]
        assert got["mean"]["a"] == [1.5, 3.5, 2.0]
        assert got["sum"]["a"] == got["sum"]["b"] == [3.0, 7.0, 4.0]
        assert got["sum"]["ints"] == [3, 9]
        for name in ("max", "min", "mean", "sum"):
            assert got[name]["input"] == [1.0 + rank, 5.0 - 3 * rank, 2.0]  # never modified in place


@pytest.mark.parametrize("name", ["avg", "product", "MAX", None])
def test_an_unknown_reduction_names_the_choices(name) -> None:
    with pytest.raises(
        ValueError, match=r"Unknown reduction .*: use one of 'mean', 'sum', 'none', 'max', 'min'"
    ):
        reduce(torch.ones(2), reduction=name)


@pytest.mark.parametrize(
    ("data", "leaf"),
    [
        ([[1, 2], [3]], "int"),
        ([{"a": [1, 2]}, {"a": [3]}], "int"),
        ([(1, "x"), (2, "y")], "int"),
        ([[torch.tensor([1]), "a"], [torch.tensor([2]), "b"]], "str"),
        ([{"a": 1.0}, {"a": 2.0}], "float"),
    ],
)
def test_concatenate_of_structures_with_other_leaves_is_a_type_error(data, leaf: str) -> None:
    with pytest.raises(TypeError, match=rf"^Can only concatenate tensors but got <class '{leaf}'>"):
        concatenate(data)


@pytest.mark.parametrize("leaf", [3, "a", None, 2.5, object()])
def test_concatenate_of_one_leaf_that_is_not_a_tensor_returns_it(leaf) -> None:
    assert concatenate([leaf]) is leaf
    assert concatenate((leaf,)) is leaf
    # Inside structures too (1.15 gives equal structures back).
    assert concatenate([{"a": leaf, "b": [leaf, torch.ones(1)]}]) == {"a": leaf, "b": [leaf, torch.ones(1)]}


def test_concatenate_of_nested_tensor_structures() -> None:
    out = concatenate([{"x": [torch.ones(1, 2)]}, {"x": [torch.zeros(2, 2)]}])
    assert out["x"][0].shape == (3, 2)


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "nested tensors are a prototype" warning
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def test_pad_across_processes_warns_on_a_nested_tensor_in_one_process() -> None:
    nested = _nested()
    with pytest.warns(CannotPadNestedTensorWarning, match="cannot pad nested tensors"):
        out = pad_across_processes({"n": nested, "t": torch.ones(2)})
    assert out["n"] is nested


def _pad_nested_worker() -> list:
    from notebook_accel.state import PartialState

    rank = PartialState(cpu=True).process_index
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pad_across_processes([_nested(), torch.ones(1 + rank)])
    return [type(w.message).__name__ for w in caught], out[1].tolist()


def test_pad_across_processes_warns_on_a_nested_tensor_and_pads_the_rest() -> None:
    for kinds, padded in run_distributed(_pad_nested_worker, nprocs=2, timeout=120):
        assert "CannotPadNestedTensorWarning" in kinds
        assert len(padded) == 2


def test_honor_type_on_a_leaf_raises_its_constructors_type_error() -> None:
    with pytest.raises(TypeError, match=r"^int\(\) argument must be"):
        honor_type(5, [1])
    with pytest.raises(TypeError, match=r"^object\(\) takes no arguments"):
        honor_type(object(), [1, 2])
    assert honor_type((1, 2), iter([3, 4])) == (3, 4)


def test_recursively_apply_error_starts_like_accelerates() -> None:
    def plus_one(t):
        return t + 1

    with pytest.raises(
        TypeError,
        match=r"^Unsupported types \(<class 'object'>\) passed to `plus_one`\. Only nested list/tuple/dicts "
        r"of objects that are valid for `is_torch_tensor` should be passed\.",
    ):
        recursively_apply(plus_one, {"a": [torch.ones(1), object()]}, error_on_other_type=True)


def test_build_device_mesh_of_all_ones_is_none_without_a_process_group() -> None:
    import torch.distributed as dist

    assert ParallelismConfig().build_device_mesh("cpu") is None
    assert ParallelismConfig(dp_shard_size=1, tp_size=1).build_device_mesh("cpu") is None
    assert not dist.is_initialized()


def _mesh_worker(init_first: bool) -> list:
    import torch.distributed as dist

    if init_first:
        dist.init_process_group("gloo")
    out = [ParallelismConfig().build_device_mesh("cpu")]  # all ones: None, the group left alone
    out.append(dist.is_initialized())
    for sizes in ({"dp_shard_size": 2}, {"dp_replicate_size": 2}, {"tp_size": 2}):
        mesh = ParallelismConfig(**sizes).build_device_mesh("cpu")
        out.append((tuple(mesh.mesh_dim_names), tuple(mesh.shape), mesh.device_type))
    return out


@pytest.mark.parametrize("init_first", [True, False], ids=["group_ready", "group_made_on_demand"])
def test_build_device_mesh_on_two_processes(init_first: bool) -> None:
    for got in run_distributed(_mesh_worker, nprocs=2, args=(init_first,), timeout=120):
        assert got[0] is None and got[1] is init_first
        assert got[2:] == [
            (("dp_shard",), (2,), "cpu"),
            (("dp_replicate",), (2,), "cpu"),
            (("tp",), (2,), "cpu"),
        ]
