"""load_checkpoint_and_dispatch(..., broadcast_from_rank0=True) in 2 real gloo processes: rank 0 reads the
checkpoint, the other rank receives every weight by broadcast and never opens a checkpoint file."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
from torch import nn

from notebook_accel.big_modeling import load_checkpoint_and_dispatch
from tests._dist import run_distributed


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


def _reference() -> TiedNet:
    torch.manual_seed(0)
    net = TiedNet().eval()
    with torch.no_grad():
        net.block[1].running_mean.normal_()
        net.block[1].running_var.uniform_(0.5, 2.0)
    return net


def _write_sharded(folder: str, net: nn.Module) -> None:
    """Two pickle shards and their index (the tied head.weight saved once, as save_model does)."""
    state = {k: v.clone() for k, v in net.state_dict().items() if k != "head.weight"}
    keys = sorted(state)
    shards = {"model-00001-of-00002.bin": keys[:3], "model-00002-of-00002.bin": keys[3:]}
    os.makedirs(folder)
    for name, names in shards.items():
        torch.save({k: state[k] for k in names}, os.path.join(folder, name))
    weight_map = {k: name for name, names in shards.items() for k in names}
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _load_on_each_rank(folder: str, kwargs: dict) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:  # every Python-level open of a checkpoint file
        if event == "open" and isinstance(args[0], str) and args[0].startswith(folder):
            opened.append(os.path.basename(args[0]))

    sys.addaudithook(audit)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("notebook_accel").addHandler(handler)
    try:
        rank = dist.get_rank()
        torch.manual_seed(100 + rank)  # each rank starts from other weights
        model = TiedNet().eval()
        # the folder does not exist for rank 1: reading, listing or even checking it would fail there
        checkpoint = folder if rank == 0 else folder + "-not-on-this-rank"
        returned = load_checkpoint_and_dispatch(model, checkpoint, broadcast_from_rank0=True, **kwargs)
        return {
            "same_model": returned is model,
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "tied": model.head.weight is model.embed.weight,
            "device_map": getattr(model, "hf_device_map", None),
            "opened": opened,
            "warnings": records,
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kwargs", [{}, {"device_map": {"embed": "cpu", "block": "cpu", "head": "cpu"}}])
def test_rank_0_reads_and_the_other_rank_receives_by_broadcast(tmp_path, kwargs) -> None:
    reference = _reference()
    folder = str(tmp_path / "ckpt")
    _write_sharded(folder, reference)
    ranks = run_distributed(_load_on_each_rank, nprocs=2, args=(folder, kwargs))
    # the index and both shards (a shard may be opened twice: its format is checked before torch reads it)
    assert sorted(set(ranks[0]["opened"])) == sorted(os.listdir(folder))
    assert ranks[1]["opened"] == []
    for rank in ranks:
        assert rank["same_model"] and rank["tied"]
        assert rank["device_map"] == kwargs.get("device_map")
        assert sorted(rank["state"]) == sorted(reference.state_dict())
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(rank["state"][key], value, rtol=0, atol=0)


def test_dtype_is_not_applied_under_broadcast_as_in_1_15(tmp_path) -> None:
    reference = _reference()
    folder = str(tmp_path / "ckpt")
    _write_sharded(folder, reference)
    ranks = run_distributed(_load_on_each_rank, nprocs=2, args=(folder, {"dtype": torch.float16}))
    for rank in ranks:
        for key, value in reference.state_dict().items():
            assert rank["state"][key].dtype == value.dtype
            torch.testing.assert_close(rank["state"][key], value, rtol=0, atol=0)  # not rounded to fp16
        assert any("dtype=torch.float16 is not applied" in message for message in rank["warnings"])
