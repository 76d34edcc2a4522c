"""The plan of a launch across nodes (no process started): ranks per node, devices, torchrun variables, labels."""

from __future__ import annotations

import io
import types

import pytest

from notebook_accel import notebook_launcher
from notebook_accel.launch.output import OutputLine, PrintSink
from notebook_accel.launch.request import LaunchRequest
from notebook_accel.nodes.plan import node_plan


def train():
    return None


def _group(gpus: int, hosts=("gpu-a.cluster.org", "gpu-b.cluster.org")):
    return types.SimpleNamespace(gpus=gpus, address="10.0.0.5", hosts=hosts)


def test_cpu_nodes_get_gloo_one_rank_each_by_default_and_the_kernels_address():
    plan = node_plan(LaunchRequest(function=train, nodes=["gpu-a", "gpu-b"]), _group(0))
    assert (plan.backend, plan.num_processes, plan.world_size, plan.start_method) == ("gloo", 1, 2, "spawn")
    assert plan.master_addr == "10.0.0.5" and not plan.in_process and plan.distributed_type == "MULTI_CPU"
    env = plan.worker_env(0, node=1)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "1", "LOCAL_RANK": "0", "NODE_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
    }  # fmt: skip
    assert env["MASTER_ADDR"] == "10.0.0.5"
    assert list(plan.supervised_ranks) == [0, 1]


def test_gpu_nodes_get_nccl_one_rank_per_device_of_the_smallest_node():
    plan = node_plan(LaunchRequest(function=train, nodes=["a", "b"]), _group(2))
    assert (plan.backend, plan.device_type, plan.num_processes, plan.world_size) == ("nccl", "cuda", 2, 4)
    assert plan.worker_env(1, node=1)["RANK"] == "3"
    with pytest.raises(ValueError, match=r"num_processes=3 is more than the 2 visible CUDA device\(s\)"):
        node_plan(LaunchRequest(function=train, num_processes=3, nodes=["a", "b"]), _group(2))


def test_one_machine_keeps_its_environment_without_node_rank():
    from notebook_accel.launch.plan import resolve_plan

    env = resolve_plan(LaunchRequest(function=train, num_processes=2)).worker_env(1)
    assert "NODE_RANK" not in env and env["RANK"] == "1"


def test_output_of_a_launch_across_nodes_is_labelled_with_the_short_host_name():
    out = io.StringIO()
    sink = PrintSink(stdout=out, num_processes=2, hosts=("gpu-a.cluster.org", "10.0.0.7"))
    sink(OutputLine(rank=1, stream="stdout", text="one", time=0.0))
    sink(OutputLine(rank=3, stream="stdout", text="three", time=0.0, attempt=2))
    assert out.getvalue() == "[gpu-a rank 1] one\n[10.0.0.7 rank 3, attempt 2] three\n"
    single = io.StringIO()
    PrintSink(stdout=single, num_processes=2)(OutputLine(rank=1, stream="stdout", text="x", time=0.0))
    assert single.getvalue() == "[rank 1] x\n"


def test_nodes_of_the_wrong_kind_are_refused_naming_the_forms():
    with pytest.raises(TypeError, match=r"nodes=42 \(a int\) is not one of the forms"):
        notebook_launcher(train, nodes=42)
