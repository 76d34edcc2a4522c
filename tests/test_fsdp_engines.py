"""FSDP1, FSDP2, HSDP and tensor parallelism trained for real on CPU processes (gloo), against DDP.

Each launch batches several checks, because starting processes is the expensive part: one 2-process
launch trains the same small transformer-like model 5 steps with DDP, FSDP1 and FSDP2 and round-trips
full and sharded checkpoints; another checks ParallelismConfig(dp_shard_size=2) and tensor
parallelism; a 4-process launch checks 2x2 HSDP.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests._dist import run_distributed

STEPS, BATCH, WIDTH = 5, 4, 8


class Block(nn.Module):
    """A transformer-like layer: norm, MLP, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyTransformer(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, WIDTH)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(STEPS * BATCH * 2, 4, generator=g), torch.randn(STEPS * BATCH * 2, 1, generator=g)
    )


def _fresh_accelerator(**kwargs):
    from notebook_accel import Accelerator
    from notebook_accel.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


def _train(acc, model, steps: int = STEPS, clip: float | None = 1.0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, DataLoader(_data(), batch_size=BATCH))
    norms = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        acc.backward(nn.functional.mse_loss(model(x), y))
        if clip is not None:
            norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return model, opt, norms


def _next_step_loss(acc, model, opt) -> float:
    x, y = _data()[:BATCH]
    loss = nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return float(acc.reduce(loss.detach(), "mean"))


def _round_trip(acc, model, opt, folder: str) -> dict:
    """Save model+optimizer with utils.save_fsdp_*, load into a fresh prepared model, compare."""
    from notebook_accel.utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )

    plugin = acc.state.fsdp_plugin
    save_fsdp_model(plugin, acc, model, folder)
    save_fsdp_optimizer(plugin, acc, opt, model, folder)
    fresh = TinyTransformer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # different weights, so a load that does nothing is seen
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = acc.prepare(fresh, fresh_opt)
    load_fsdp_model(plugin, acc, fresh, folder)
    load_fsdp_optimizer(plugin, acc, fresh_opt, fresh, folder)
    same = {k: torch.equal(v, acc.get_state_dict(fresh)[k]) for k, v in acc.get_state_dict(model).items()}
    return {
        "files": sorted(os.listdir(folder)),
        "same_weights": all(same.values()) and len(same) > 0,
        "next_loss": (_next_step_loss(acc, model, opt), _next_step_loss(acc, fresh, fresh_opt)),
    }


def _engines_worker(tmp: str) -> dict:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    from notebook_accel.utils import FullyShardedDataParallelPlugin

    out: dict = {}
    acc = _fresh_accelerator()
    model, _, out["ddp_norms"] = _train(acc, TinyTransformer())
    out["ddp"] = acc.get_state_dict(model)

    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")
    acc = _fresh_accelerator(fsdp_plugin=plugin)
    model, opt, out["fsdp1_norms"] = _train(acc, TinyTransformer())
    out["fsdp1_type"] = type(model) is FullyShardedDataParallel
    out["fsdp1_units"] = sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    out["fsdp1"] = acc.get_state_dict(model)
    out["fsdp1_full_rt"] = _round_trip(acc, model, opt, os.path.join(tmp, "fsdp1_full"))
    acc.save_model(model, os.path.join(tmp, "fsdp1_saved"), max_shard_size="1KB")

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", activation_checkpointing=True
    )
    acc = _fresh_accelerator(fsdp_plugin=plugin)
    model, opt, out["fsdp2_norms"] = _train(acc, TinyTransformer())
    block = model.layers[0]
    out["fsdp2_checkpointed"] = type(block).__name__ == "CheckpointWrapper"
    block = getattr(block, "_checkpoint_wrapped_module", block)
    out["fsdp2_sharded"] = [isinstance(m, FSDPModule) for m in (model, block, model.head)]
    local = model.embed.weight.to_local()
    out["fsdp2_local_rows"] = local.shape[0]
    out["fsdp2"] = acc.get_state_dict(model)
    out["fsdp2_unwrapped_keys"] = sorted(acc.unwrap_model(model).state_dict()) == sorted(out["fsdp2"])
    out["fsdp2_sharded_rt"] = _round_trip(acc, model, opt, os.path.join(tmp, "fsdp2_sharded"))
    plugin.set_state_dict_type("FULL_STATE_DICT")
    out["fsdp2_full_rt"] = _round_trip(acc, model, opt, os.path.join(tmp, "fsdp2_full"))
    acc.save_state(os.path.join(tmp, "fsdp2_state"))
    before = acc.get_state_dict(model)
    _next_step_loss(acc, model, opt)
    acc.load_state(os.path.join(tmp, "fsdp2_state"))
    out["fsdp2_state_restored"] = all(torch.equal(v, acc.get_state_dict(model)[k]) for k, v in before.items())
    return out


def test_fsdp1_and_fsdp2_match_ddp_and_round_trip_checkpoints(tmp_path) -> None:
    results = run_distributed(_engines_worker, nprocs=2, args=(str(tmp_path),), timeout=300)
    r0 = results[0]
    for engine in ("fsdp1", "fsdp2"):
        for name, ddp_value in r0["ddp"].items():
            torch.testing.assert_close(r0[engine][name], ddp_value, rtol=0, atol=1e-5, msg=f"{engine} {name}")
        assert r0[f"{engine}_norms"] == pytest.approx(r0["ddp_norms"], abs=1e-5)
    assert r0["fsdp1_type"] and r0["fsdp1_units"] == 3  # the root and the two Block layers
    assert (
        r0["fsdp2_checkpointed"]
        and r0["fsdp2_sharded"] == [True, True, False]
        and r0["fsdp2_local_rows"] == WIDTH // 2
    )
    assert r0["fsdp2_unwrapped_keys"]
    for check in ("fsdp1_full_rt", "fsdp2_sharded_rt", "fsdp2_full_rt"):
        for r in results:
            assert r[check]["same_weights"], check
            assert r[check]["next_loss"][0] == r[check]["next_loss"][1], check
    assert r0["fsdp1_full_rt"]["files"] == ["optimizer.bin", "pytorch_model_fsdp.bin"]
    assert r0["fsdp2_sharded_rt"]["files"] == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert r0["fsdp2_state_restored"] and results[1]["fsdp2_state_restored"]
    saved = sorted(os.listdir(tmp_path / "fsdp1_saved"))
    assert "model.safetensors.index.json" in saved and len(saved) > 2  # sharded safetensors

    from notebook_accel.utils import merge_fsdp_weights

    merged = merge_fsdp_weights(
        str(tmp_path / "fsdp2_sharded" / "pytorch_model_fsdp_0"), str(tmp_path / "merged")
    )
    from safetensors.torch import load_file

    assert sorted(load_file(merged)) == sorted(r0["ddp"])


def _mesh_worker() -> dict:
    from notebook_accel.parallelism_config import ParallelismConfig

    acc = _fresh_accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    model, _, norms = _train(acc, TinyTransformer())
    return {
        "type": acc.distributed_type.value,
        "fsdp_version": acc.state.fsdp_plugin.fsdp_version,
        "mesh": acc.torch_device_mesh.mesh_dim_names,
        "ranks": (acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank),
        "weights": acc.get_state_dict(model),
        "norms": norms,
    }


class TpMLP(nn.Module):
    tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tp_worker() -> dict:
    from torch.distributed.tensor import DTensor

    from notebook_accel.parallelism_config import ParallelismConfig

    acc = _fresh_accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    model = TpMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(_data(), batch_size=BATCH))
    seen = []
    for step, (x, y) in enumerate(loader):
        if step == 3:
            break
        seen.append(x.sum().item())
        acc.backward(nn.functional.mse_loss(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
    return {
        "dtensor": isinstance(model.up.weight, DTensor),
        "local_rows": model.up.weight.to_local().shape[0],
        "seen": seen,
        "weights": {k: v.full_tensor() for k, v in model.state_dict().items()},
        "tp_rank": acc.tensor_parallel_rank,
    }


def test_parallelism_config_dp_shard_and_tensor_parallel_on_two_processes() -> None:
    sharded = run_distributed(_mesh_worker, nprocs=2, timeout=300)
    ddp = run_distributed(_ddp_reference_worker, nprocs=2, timeout=300)[0]
    assert sharded[0]["type"] == "FSDP" and sharded[0]["fsdp_version"] == 2
    assert sharded[0]["mesh"] == ("dp_shard",)
    assert [r["ranks"] for r in sharded] == [(0, 0, 0), (1, 1, 0)]
    for name, value in ddp["weights"].items():
        torch.testing.assert_close(sharded[0]["weights"][name], value, rtol=0, atol=1e-5)

    tp = run_distributed(_tp_worker, nprocs=2, timeout=300)
    assert tp[0]["dtensor"] and tp[0]["local_rows"] == 4 and [r["tp_rank"] for r in tp] == [0, 1]
    assert tp[0]["seen"] == tp[1]["seen"]  # one tensor-parallel group: both ranks read the same batches
    reference = TpMLP()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, (x, y) in enumerate(DataLoader(_data(), batch_size=BATCH)):
        if step == 3:
            break
        nn.functional.mse_loss(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(tp[0]["weights"][name], value, rtol=0, atol=1e-5)


def _ddp_reference_worker() -> dict:
    acc = _fresh_accelerator()
    model, _, norms = _train(acc, TinyTransformer())
    return {"weights": acc.get_state_dict(model), "norms": norms}


def _hsdp_worker() -> dict:
    from notebook_accel.parallelism_config import ParallelismConfig

    acc = _fresh_accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    model, _, _ = _train(acc, TinyTransformer(), steps=2)
    mesh = model.embed.weight.device_mesh
    return {
        "mesh": acc.torch_device_mesh.mesh_dim_names,
        "fsdp_mesh": mesh.mesh_dim_names,
        "local_rows": model.embed.weight.to_local().shape[0],
        "dp_rank": acc.data_parallel_rank,
        "weights": acc.get_state_dict(model),
    }


def _ddp4_worker() -> dict:
    acc = _fresh_accelerator()
    model, _, _ = _train(acc, TinyTransformer(), steps=2)
    return {"weights": acc.get_state_dict(model)}


def test_hsdp_2x2_on_four_processes() -> None:
    hsdp = run_distributed(_hsdp_worker, nprocs=4, timeout=300)
    ddp = run_distributed(_ddp4_worker, nprocs=4, timeout=300)[0]
    assert hsdp[0]["mesh"] == ("dp_replicate", "dp_shard") and hsdp[0]["fsdp_mesh"] == (
        "dp_replicate",
        "dp_shard_cp",
    )
    assert hsdp[0]["local_rows"] == WIDTH // 2  # sharded over 2, replicated over the other 2
    assert sorted(r["dp_rank"] for r in hsdp) == [0, 1, 2, 3]
    for name, value in ddp["weights"].items():
        torch.testing.assert_close(hsdp[0]["weights"][name], value, rtol=0, atol=1e-5)


def _bad_sizes_worker() -> str:
    from notebook_accel.parallelism_config import ParallelismConfig

    try:
        _fresh_accelerator(parallelism_config=ParallelismConfig(dp_shard_size=4))
    except ValueError as exc:
        first = str(exc)
    try:
        acc = _fresh_accelerator(parallelism_config=ParallelismConfig(tp_size=2))
        acc.prepare(TinyTransformer())
    except ValueError as exc:
        return first + " || " + str(exc)
    return first + " || no error"


def test_bad_sizes_and_a_model_without_tp_plan_raise() -> None:
    first, second = run_distributed(_bad_sizes_worker, nprocs=2, timeout=120)[0].split(" || ")
    assert "sizes multiply to 4 (dp_replicate_size=1, dp_shard_size=4" in first and "2 processes" in first
    assert "ParallelismConfig(tp_size=2): TinyTransformer has no tensor-parallel plan" in second


def _ram_efficient_worker() -> dict:
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    out = {}
    for version in (1, 2):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=version, cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap"
        )
        acc = _fresh_accelerator(fsdp_plugin=plugin)
        if acc.process_index == 0:
            model = TinyTransformer()
        else:  # only rank 0 loads the weights; the others hold an empty (meta) model
            with torch.device("meta"):
                model = TinyTransformer()
        model = acc.prepare(model)
        out[version] = acc.get_state_dict(model)
    return out


def test_cpu_ram_efficient_loading_fills_meta_ranks_from_rank0() -> None:
    results = run_distributed(_ram_efficient_worker, nprocs=2, timeout=300)
    reference = TinyTransformer().state_dict()
    for version in (1, 2):
        for rank, r in enumerate(results):
            for name, value in reference.items():
                assert torch.equal(r[version][name], value), (version, rank, name)
