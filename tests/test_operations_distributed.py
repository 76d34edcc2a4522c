"""Every data operation in 2 real processes (gloo), including debug-mode shape checks."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch

from notebook_accel.state import PartialState
from notebook_accel.utils import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from tests._dist import run_distributed


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


def _count_object_collectives(monkeypatch_calls: list) -> None:
    import torch.distributed as dist

    original = dist.all_gather_object

    def counting(*args, **kwargs):
        monkeypatch_calls.append("all_gather_object")
        return original(*args, **kwargs)

    dist.all_gather_object = counting


def _all_operations() -> dict:
    rank = PartialState().process_index
    calls: list = []
    _count_object_collectives(calls)
    out: dict = {}
    r = float(rank)

    # gather: one tensor, a 0-dim tensor, and a nested structure of mixed dtypes (coalesced)
    out["gather_one"] = gather(torch.full((2, 2), r)).tolist()
    out["gather_scalar"] = gather(torch.tensor(r)).tolist()
    nested = {
        "pair": Pair(torch.tensor([r, r + 0.5]), torch.full((1, 3), rank, dtype=torch.int64)),
        "list": [torch.tensor([rank == 1, True]), torch.tensor(r * 10)],
        "ordered": OrderedDict(h=torch.tensor([r], dtype=torch.float16)),
        "strided": torch.arange(6.0).reshape(2, 3).t() + r,
    }
    g = gather(nested)
    out["gather_nested"] = {
        "types": (type(g["pair"]).__name__, type(g["ordered"]).__name__),
        "pair": (g["pair"].first.tolist(), g["pair"].second.tolist()),
        "list": (g["list"][0].tolist(), g["list"][1].tolist()),
        "half": (g["ordered"]["h"].dtype == torch.float16, g["ordered"]["h"].tolist()),
        "strided": g["strided"].tolist(),
    }
    out["gather_object"] = (gather_object([rank, f"r{rank}"]), gather_object({"rank": rank}))

    # reduce: mean / sum on one tensor and on a structure; integers give a float mean; input untouched
    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    out["reduce_one"] = (reduce(x).tolist(), reduce(x, "sum").tolist(), x.tolist(), reduce(x, "none") is x)
    structure = {
        "a": torch.tensor([rank + 1]),
        "b": [torch.full((2, 2), r)],
        "c": torch.tensor([1.0, 3.0]) * rank,
    }
    out["reduce_bool"] = (
        reduce(torch.tensor([True, rank == 1]), "sum").tolist(),
        reduce([torch.tensor(rank == 1)])[0].item(),
    )
    mean, summed = reduce(structure), reduce(structure, reduction="sum")
    out["reduce_nested"] = (
        mean["a"].tolist(),
        mean["b"][0].tolist(),
        mean["c"].tolist(),
        summed["a"].tolist(),
    )

    # broadcast: in place, from rank 1, on one tensor, a non-contiguous one and a structure
    one = torch.full((3,), r)
    broadcast(one, from_process=1)
    wide = torch.zeros(3, 2)
    strided = wide.t()
    strided += r
    broadcast(strided, from_process=1)
    tree = {
        "a": torch.tensor([r, r]),
        "b": Pair(torch.tensor([rank]), torch.tensor([r * 2])),
        "c": torch.full((2,), r),
    }
    same = broadcast(tree, from_process=1)
    out["broadcast"] = (
        one.tolist(),
        wide.tolist(),
        same is tree,
        tree["a"].tolist(),
        tree["b"].first.tolist(),
        tree["b"].second.tolist(),
        tree["c"].tolist(),
    )
    objects = [f"from {rank}", {"rank": rank}]
    out["broadcast_object_list"] = broadcast_object_list(objects, from_process=1) is objects and objects

    # pad_across_processes: different lengths, pad_first, negative dim, a tensor too small for dim
    ragged = torch.ones(rank + 1, 2)
    out["pad"] = pad_across_processes(ragged, pad_index=-1).tolist()
    out["pad_first"] = pad_across_processes(torch.ones(2, rank + 1), dim=-1, pad_first=True).tolist()
    padded = pad_across_processes(
        {"x": [torch.arange(rank + 2)], "scalar": torch.tensor(5.0), "same": torch.ones(2)}
    )
    out["pad_nested"] = (padded["x"][0].tolist(), padded["scalar"].tolist(), padded["same"].tolist())
    out["pad_then_gather"] = gather(pad_across_processes(torch.arange(rank + 1))).tolist()
    # tensors that carry autograd history or are views still work (results are detached data)
    weight = torch.full((2,), r + 1, requires_grad=True)
    loss = weight * 2
    leaf = torch.full((2,), r, requires_grad=True)
    broadcast({"leaf": leaf, "other": torch.ones(1)}, from_process=1)
    broadcast(leaf, from_process=0)
    out["grad_leaf"] = leaf.tolist()
    out["grad_inputs"] = (
        gather(loss).tolist(),
        reduce(loss).tolist(),
        gather({"w": weight, "t": weight.t()})["w"].tolist(),
    )
    with pytest.raises(TypeError, match="Unsupported type str passed to `gather`"):
        gather([torch.ones(1), "text"])
    out["object_collectives"] = len(calls) - 2  # the two gather_object calls above
    return out


def test_all_operations_in_two_processes():
    results = run_distributed(_all_operations)
    for rank, res in enumerate(results):
        assert res["gather_one"] == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert res["gather_scalar"] == [0.0, 1.0]
        nested = res["gather_nested"]
        assert nested["types"] == ("Pair", "OrderedDict")
        assert nested["pair"] == ([0.0, 0.5, 1.0, 1.5], [[0, 0, 0], [1, 1, 1]])
        assert nested["list"] == ([False, True, True, True], [0.0, 10.0])
        assert nested["half"] == (True, [0.0, 1.0])
        assert nested["strided"] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0], [1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]
        assert res["gather_object"] == ([0, "r0", 1, "r1"], [{"rank": 0}, {"rank": 1}])
        assert res["reduce_one"] == ([1.5, 3.0], [3.0, 6.0], [1.0 * (rank + 1), 2.0 * (rank + 1)], True)
        assert res["reduce_bool"] == ([2, 1], 0.5)
        assert res["reduce_nested"] == ([1.5], [[0.5, 0.5], [0.5, 0.5]], [0.5, 1.5], [3])
        assert res["broadcast"] == (
            [1.0] * 3,
            [[1.0, 1.0]] * 3,
            True,
            [1.0, 1.0],
            [1],
            [2.0],
            [1.0, 1.0],
        )
        assert res["broadcast_object_list"] == ["from 1", {"rank": 1}]
        assert res["pad_nested"][1:] == (5.0, [1.0, 1.0])
        assert res["pad_then_gather"] == [0, 0, 0, 1]
        assert res["grad_inputs"] == ([2.0, 2.0, 4.0, 4.0], [3.0, 3.0], [1.0, 1.0, 2.0, 2.0])
        assert res["grad_leaf"] == [1.0, 1.0]
        assert res["object_collectives"] == 0  # no debug mode: no extra collective
    assert results[0]["pad"] == [[1.0, 1.0], [-1.0, -1.0]] and results[1]["pad"] == [[1.0, 1.0], [1.0, 1.0]]
    assert results[0]["pad_first"] == [[0.0, 1.0], [0.0, 1.0]] and results[1]["pad_first"] == [[1.0, 1.0]] * 2
    assert results[0]["pad_nested"][0] == [0, 1, 0] and results[1]["pad_nested"][0] == [0, 1, 2]


def _debug_mode_mismatches() -> dict:
    state = PartialState()
    rank = state.process_index
    out: dict = {"debug": state.debug}
    with pytest.raises(DistributedOperationException, match="Cannot apply `gather`") as err:
        gather(torch.ones(rank + 1, 2))
    out["gather"] = str(err.value)
    with pytest.raises(DistributedOperationException, match="Cannot apply `reduce`") as err:
        reduce({"loss": torch.ones(2, dtype=torch.float16 if rank else torch.float32)})
    out["reduce"] = str(err.value)
    with pytest.raises(DistributedOperationException, match="Cannot apply `broadcast`") as err:
        broadcast([torch.ones(3)] * (rank + 1))
    out["broadcast"] = str(err.value)
    with pytest.raises(DistributedOperationException, match="Cannot apply `pad_across_processes`") as err:
        pad_across_processes(torch.ones(2) if rank else torch.ones(2, 2))
    out["pad"] = str(err.value)
    # After a caught mismatch every process is still in step: matching calls keep working.
    out["gather_ok"] = gather(torch.tensor([rank])).tolist()
    out["pad_ok"] = pad_across_processes(torch.ones(rank + 1)).tolist()
    return out


def test_debug_mode_reports_every_rank_shapes():
    results = run_distributed(_debug_mode_mismatches, env={"ACCELERATE_DEBUG_MODE": "1"})
    for res in results:
        assert res["debug"] is True
        assert "Process 0: float32[1, 2]\n  - Process 1: float32[2, 2]" in res["gather"]
        assert "Operation: `notebook_accel.utils.operations.gather`" in res["gather"]
        assert "Process 0: {'loss': float32[2]}\n  - Process 1: {'loss': float16[2]}" in res["reduce"]
        assert "Process 0: [float32[3]]\n  - Process 1: [float32[3], float32[3]]" in res["broadcast"]
        assert "number of dimensions" in res["pad"] and "Process 0: float32[2, 2]" in res["pad"]
        assert res["gather_ok"] == [0, 1]
    assert results[0]["pad_ok"] == [1.0, 0.0]
    assert results[0]["gather"] == results[1]["gather"]


def _nccl_operations() -> dict:
    state = PartialState()
    rank = state.process_index
    device = state.device
    data = {"a": torch.full((2,), float(rank), device=device), "b": [torch.tensor([rank], device=device)]}
    gathered = gather(data)
    reduced = reduce(data["a"])
    broadcast(data, from_process=1)
    padded = pad_across_processes(torch.ones(rank + 1, device=device))
    return {
        "type": state.distributed_type.value,
        "device": str(device),
        "backend": state.backend,
        "gathered": (gathered["a"].tolist(), gathered["b"][0].tolist()),
        "reduced": reduced.tolist(),
        "broadcast": data["a"].tolist(),
        "padded": (padded.tolist(), padded.device.type),
    }


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_operations_over_nccl():
    results = run_distributed(_nccl_operations)
    for rank, res in enumerate(results):
        assert res["type"] == "MULTI_GPU" and res["device"] == f"cuda:{rank}" and res["backend"] == "nccl"
        assert res["gathered"] == ([0.0, 0.0, 1.0, 1.0], [0, 1])
        assert res["reduced"] == [0.5, 0.5] and res["broadcast"] == [1.0, 1.0]
        assert res["padded"][1] == "cuda"
    assert results[0]["padded"][0] == [1.0, 0.0]
