"""Resuming FSDP training in new processes: ``save_state`` after 3 steps, a new launch, ``load_state``, 2 more.

Every combination of FSDP version (1, 2), state-dict type (full, sharded) and optimizer (SGD, SGD with
momentum, AdamW) must end on the same weights as the run that was never interrupted. Starting
processes is the expensive part, so two 2-process gloo launches run all twelve cases in sequence: the
first trains 5 steps straight and saves after step 3, the second starts from fresh models, loads and
trains steps 4 and 5. Plain SGD has no tensor state to shard, which is what broke torch's loading of a
full optimizer state ("Expected device to be set").
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from torch import nn

from tests._dist import run_distributed
from tests.test_fsdp_engines import BATCH, TinyTransformer, _data, _fresh_accelerator

CASES = list(
    itertools.product((1, 2), ("FULL_STATE_DICT", "SHARDED_STATE_DICT"), ("sgd", "momentum", "adamw"))
)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if name == "momentum" else 0.0)


def _case(version: int, state_dict_type: str, opt_name: str):
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version, state_dict_type=state_dict_type, auto_wrap_policy="transformer_based_wrap"
    )
    acc = _fresh_accelerator(fsdp_plugin=plugin)
    model = TinyTransformer()
    model, opt = acc.prepare(model, _optimizer(opt_name, model.parameters()))
    return acc, model, opt


def _step(acc, model, opt, step: int) -> None:
    start = (2 * step + acc.process_index) * BATCH  # each rank its own batch: gradients must be averaged
    x, y = _data()[start : start + BATCH]
    acc.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()


def _resume_worker(folder: str, phase: str) -> dict:
    out = {}
    for version, kind, opt_name in CASES:
        case = f"v{version}-{kind}-{opt_name}"
        acc, model, opt = _case(version, kind, opt_name)
        path = os.path.join(folder, case)
        if phase == "straight":
            for step in range(3):
                _step(acc, model, opt, step)
            acc.register_save_state_pre_hook(
                lambda models, weights, _: out.setdefault("hook", []).append(weights)
            )
            acc.save_state(path)
            out[case + "/files"] = sorted(f for f in os.listdir(path) if not f.startswith("random_states"))
        else:
            acc.load_state(path)
        for step in range(3, 5):
            _step(acc, model, opt, step)
        out[case] = acc.get_state_dict(model)
    return out


def test_fsdp_resumes_in_new_processes_to_the_uninterrupted_weights(tmp_path) -> None:
    straight = run_distributed(_resume_worker, nprocs=2, args=(str(tmp_path), "straight"), timeout=600)
    resumed = run_distributed(_resume_worker, nprocs=2, args=(str(tmp_path), "resumed"), timeout=600)
    untrained = TinyTransformer().state_dict()
    assert straight[0]["hook"] == [[]] * len(CASES)  # as in 1.15: FSDP weights are not gathered for the hooks
    for version, kind, opt_name in CASES:
        case = f"v{version}-{kind}-{opt_name}"
        expected = straight[0][case]
        assert any(not torch.equal(expected[k], v) for k, v in untrained.items()), case
        for rank in (0, 1):
            for name, value in expected.items():
                assert torch.equal(resumed[rank][case][name], value), (case, rank, name)
        # Accelerate 1.15's FSDP checkpoint layout: one file each, or one torch.distributed.checkpoint folder each.
        files = straight[0][case + "/files"]
        if kind == "FULL_STATE_DICT":
            assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(files), (case, files)
        else:
            assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(files), (case, files)
            assert "optimizer.bin" not in files and "model.safetensors" not in files, (case, files)


def _load_with_a_file_missing_worker(folder: str) -> dict:
    acc, model, opt = _case(2, "SHARDED_STATE_DICT", "adamw")
    scheduler = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1))
    _step(acc, model, opt, 0)
    scheduler.step()
    acc.save_state(folder)
    if acc.is_main_process:
        os.remove(os.path.join(folder, "scheduler.bin"))
    acc.wait_for_everyone()
    _step(acc, model, opt, 1)
    before = acc.get_state_dict(model)
    try:
        acc.load_state(folder)
        error = None
    except FileNotFoundError as exc:
        error = str(exc)
    after = acc.get_state_dict(model)
    out = {"error": error, "untouched": all(torch.equal(before[k], after[k]) for k in before)}
    # A file missing for one process only (an object registered on rank 1 alone): the other process
    # must not wait for it in the shards' collective load.
    complete = os.path.join(folder, "complete")
    acc.save_state(complete)
    if acc.process_index == 1:
        acc.register_for_checkpointing(torch.nn.Linear(1, 1))
    try:
        acc.load_state(complete)
    except Exception as exc:
        out["one_rank"] = f"{type(exc).__name__}: {exc}"
    return out


def test_fsdp_load_checks_every_file_before_loading_the_shards(tmp_path) -> None:
    # Before, the shards were loaded first: a missing scheduler file then left new weights with an
    # old optimizer step count and the rest of the run as it was.
    results = run_distributed(_load_with_a_file_missing_worker, nprocs=2, args=(str(tmp_path),), timeout=120)
    for result in results:
        assert "scheduler.bin for scheduler 0" in result["error"], result
        assert result["untouched"], result
    assert (
        results[1]["one_rank"].startswith("FileNotFoundError")
        and "registered object 0" in results[1]["one_rank"]
    )
    assert results[0]["one_rank"].startswith(
        "RuntimeError: load_state failed on process(es) [1] while reading"
    )


@pytest.mark.parametrize("bad", ["LOCAL_STATE_DICT"])
def test_local_state_dict_checkpoints_are_refused_with_the_way_out(bad: str) -> None:
    from notebook_accel.utils import FullyShardedDataParallelPlugin, save_fsdp_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=bad)
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT .* use SHARDED_STATE_DICT"):
        save_fsdp_model(plugin, None, nn.Linear(2, 2), "unused")


# ---------------------------------------------------------------------------------- re-running the cell
def _plugin(**kwargs):
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **kwargs)


def test_rerun_cell_with_an_equal_fsdp_plugin_is_accepted_and_a_different_one_named() -> None:
    from notebook_accel import Accelerator

    first = _plugin(reshard_after_forward=True)
    Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=first)
    # What preparing a model does to the plugin in place: the mixed precision is filled in.
    first.set_mixed_precision("bf16")
    again = _plugin(reshard_after_forward=True)
    acc = Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=again)
    assert acc.state.fsdp_plugin is again  # later edits to the cell's plugin apply
    assert acc.distributed_type.value == "FSDP"
    with pytest.raises(
        ValueError, match=r"already set up with a different one \(reshard_after_forward: True != False\)"
    ):
        Accelerator(cpu=True, mixed_precision="bf16", fsdp_plugin=_plugin(reshard_after_forward=False))
    with pytest.raises(ValueError, match=r"fsdp_version: 2 != 1; .*state_dict_type: .*SHARDED.* != .*FULL"):
        from notebook_accel.utils import FullyShardedDataParallelPlugin

        Accelerator(
            cpu=True, mixed_precision="bf16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)
        )
    assert acc.state.fsdp_plugin is again  # a refused plugin changes nothing


def test_rerun_cell_with_an_equal_fsdp1_plugin_after_prepare_resolved_its_policy() -> None:
    from notebook_accel import Accelerator
    from notebook_accel.utils import FullyShardedDataParallelPlugin

    first = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")
    Accelerator(cpu=True, fsdp_plugin=first)
    first.set_auto_wrap_policy(TinyTransformer())  # what FSDP1's prepare does: the name becomes a callable
    Accelerator(
        cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")
    )
    with pytest.raises(ValueError, match=r"auto_wrap_policy: 'TRANSFORMER_BASED_WRAP' != 'SIZE_BASED_WRAP'"):
        Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap"))


def _parallelism_rerun_worker() -> dict:
    from notebook_accel import Accelerator
    from notebook_accel.parallelism_config import ParallelismConfig

    first = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    again = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    out = {
        "accepted": again.state.fsdp_plugin.fsdp_version == 2
        and first.state.parallelism_config.dp_shard_size == 2
    }
    try:
        Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def test_rerun_cell_with_an_equal_parallelism_config_is_accepted() -> None:
    r0 = run_distributed(_parallelism_rerun_worker, nprocs=2, timeout=300)[0]
    assert r0["accepted"]
    with pytest.raises(ValueError, match=r"parallelism_config .* \(dp_shard_size: 2 != 1; tp_size: 1 != 2"):
        raise ValueError(r0.get("error", "no error raised"))
