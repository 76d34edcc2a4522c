"""LocalSGD: local steps without gradient all-reduce, weights averaged every k steps (2 real processes)."""

from __future__ import annotations

import pytest
import torch

from notebook_accel import Accelerator
from notebook_accel.local_sgd import LocalSGD
from tests._dist import run_distributed


def _worker(local_sgd_steps: int, steps: int):
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.full((1, 2), float(rank + 1))  # different data per rank: local steps diverge
    seen = []
    with LocalSGD(accelerator, model, local_sgd_steps=local_sgd_steps) as local_sgd:
        for _ in range(steps):
            accelerator.backward(model(x).sum())
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            seen.append(accelerator.unwrap_model(model).weight.detach().clone().tolist())
    return seen, accelerator.unwrap_model(model).weight.detach().tolist()


def test_weights_diverge_locally_and_are_averaged_every_k_steps() -> None:
    (seen0, final0), (seen1, final1) = run_distributed(_worker, nprocs=2, args=(2, 3))
    # step 1: local only (each rank moved by its own gradient: -0.5 * (rank + 1) per weight)
    assert seen0[0] != seen1[0]
    start = [seen0[0][0][0] + 0.5, seen0[0][0][1] + 0.5]
    # step 2: averaged, the mean of both ranks' local moves (-0.5*1*2 and -0.5*2*2 -> mean -1.5)
    assert seen0[1] == seen1[1]
    assert seen0[1][0] == pytest.approx([start[0] - 1.5, start[1] - 1.5])
    # step 3 is local again, and leaving the block averages once more
    assert seen0[2] != seen1[2] and final0 == final1


def test_local_sgd_validates_its_arguments() -> None:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="local_sgd_steps must be a positive int, got 0"):
        LocalSGD(accelerator, model, local_sgd_steps=0)
    # One process: nothing to average; the helper runs as a no-op.
    with LocalSGD(accelerator, model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
    assert local_sgd.num_steps == 1 and not local_sgd.enabled


def _record_ranks(out):
    import os

    return os.environ["LOCAL_RANK"], os.environ["RANK"], os.environ.get("ACCELERATE_DEBUG_MODE"), out


def test_prepare_for_launch_sets_the_rank_variables(monkeypatch) -> None:
    from notebook_accel.launchers import PrepareForLaunch, test_launch

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("NODE_RANK", "1")
    wrapped = PrepareForLaunch(_record_ranks, distributed_type="MULTI_CPU", debug=True)
    assert wrapped(2, "x") == ("2", "6", "true", "x")
    with pytest.raises(ValueError, match="distributed_type='MULTI_QPU' is not valid"):
        PrepareForLaunch(_record_ranks, distributed_type="MULTI_QPU")
    with pytest.raises(TypeError, match="needs a function to launch, got 3"):
        PrepareForLaunch(3)
    monkeypatch.delenv("RANK")
    test_launch()  # one process: the state builds


def test_fp8_environment_round_trip() -> None:
    import argparse

    from notebook_accel.utils import TERecipeKwargs
    from notebook_accel.utils.environment import patch_environment
    from notebook_accel.utils.launch import env_var_path_add, setup_fp8_env

    args = argparse.Namespace(
        fp8_format="E4M3", fp8_margin=2, fp8_override_linear_precision=(True, False, True), other=1
    )
    env = setup_fp8_env(args, {})
    assert env["ACCELERATE_FP8_FORMAT"] == "E4M3" and env["ACCELERATE_FP8_OVERRIDE_WGRAD"] == "True"
    assert "other" not in str(env)
    with patch_environment(**env):
        recipe = TERecipeKwargs()
    assert (recipe.fp8_format, recipe.margin, recipe.override_linear_precision) == (
        "E4M3",
        2,
        (True, False, True),
    )
    with patch_environment(SOME_PATH="a"):
        assert env_var_path_add("SOME_PATH", "b").split(":") == ["a", "b"]
