"""Accelerator.profile: torch.profiler on CPU processes, one Chrome trace per rank holding the model's ops."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests._dist import run_distributed


def _profile_worker(folder: str) -> dict:
    from notebook_accel import Accelerator
    from notebook_accel.utils import ProfileKwargs

    handler = ProfileKwargs(
        activities=["cpu"], record_shapes=True, profile_memory=True, output_trace_dir=folder
    )
    acc = Accelerator(kwargs_handlers=[handler])
    model = acc.prepare(torch.nn.Linear(16, 8))
    with acc.profile() as prof:
        model(torch.randn(4, 16)).sum().backward()
    ready = []
    scheduled = ProfileKwargs(
        schedule_option={"wait": 1, "warmup": 1, "active": 1}, on_trace_ready=ready.append
    )
    with acc.profile(scheduled) as prof2:
        for _ in range(4):
            model(torch.randn(4, 16))
            prof2.step()
    names = {event.key for event in prof.key_averages()}
    return {"has_addmm": "aten::addmm" in names, "ready_calls": len(ready), "rank": acc.process_index}


def test_profile_writes_one_trace_per_rank_with_the_model_ops(tmp_path) -> None:
    results = run_distributed(_profile_worker, nprocs=2, args=(str(tmp_path),), timeout=180)
    assert [r["has_addmm"] for r in results] == [True, True]
    assert [r["ready_calls"] for r in results] == [1, 1]  # wait 1, warmup 1, active 1: one cycle in 4 steps
    assert sorted(os.listdir(tmp_path)) == ["trace_rank0.json", "trace_rank1.json"]
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        ops = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::addmm" in ops  # the Linear layer's matmul, recorded on this rank
        shapes = [e["args"].get("Input Dims") for e in trace["traceEvents"] if e.get("name") == "aten::addmm"]
        assert [8] in shapes[0] and [4, 16] in shapes[0]  # record_shapes: bias, input


def test_profile_rejects_other_handlers() -> None:
    from notebook_accel import Accelerator

    acc = Accelerator(cpu=True)
    with pytest.raises(TypeError, match="profile_handler must be a ProfileKwargs, got dict"):
        with acc.profile({"activities": ["cpu"]}):
            pass
