"""Accelerate 1.15's environment helpers: choices, env files, CPU ranks, purging, device facts."""

from __future__ import annotations

import os
import unittest

import pytest

from notebook_accel.utils import device_info
from notebook_accel.utils.environment import (
    CPUInformation,
    are_libraries_initialized,
    check_cuda_p2p_ib_support,
    convert_dict_to_env_variables,
    get_cpu_distributed_information,
    get_current_device_type,
    get_gpu_info,
    parse_choice_from_env,
    purge_accelerate_environment,
)


def test_parse_choice_and_libraries(monkeypatch) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert parse_choice_from_env("ACCELERATE_MIXED_PRECISION") == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert parse_choice_from_env("ACCELERATE_MIXED_PRECISION", "fp16") == "bf16"
    assert are_libraries_initialized("os", "no_such_module_xyz", "pytest") == ["os", "pytest"]


def test_convert_dict_to_env_variables_skips_unsafe_entries(caplog) -> None:
    env = {"ACCELERATE_DEBUG_MODE": "1", "BAD": "<mything", "EMPTY": "", "SP ACE": "2", "PATHS": "/a/b-1:/c"}
    assert convert_dict_to_env_variables(env) == ["ACCELERATE_DEBUG_MODE=1\n", "PATHS=/a/b-1:/c\n"]
    assert "Skipping BAD=<mything" in caplog.text and "Skipping SP ACE=2" in caplog.text


def test_cpu_distributed_information_reads_launcher_variables(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert get_cpu_distributed_information() == CPUInformation()
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    assert get_cpu_distributed_information() == CPUInformation(
        rank=3, world_size=4, local_rank=1, local_world_size=2
    )


def test_purge_accelerate_environment_on_a_function(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)

    @purge_accelerate_environment
    def configure() -> str:
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["ACCELERATE_USE_CPU"] = "true"
        return "done"

    assert configure() == "done"
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ and os.environ["ACCELERATE_USE_CPU"] == "false"
    with pytest.raises(TypeError, match="decorates a function or a class, got 3"):
        purge_accelerate_environment(3)


def test_purge_accelerate_environment_on_classes_and_subclasses(monkeypatch) -> None:
    monkeypatch.delenv("ACCELERATE_X", raising=False)

    @purge_accelerate_environment
    class Base(unittest.TestCase):
        def test_sets(self) -> None:
            os.environ["ACCELERATE_X"] = "1"

    class Child(Base):
        def test_child_sets(self) -> None:
            os.environ["ACCELERATE_X"] = "2"

    for case in (Base("test_sets"), Child("test_sets"), Child("test_child_sets")):
        case.test_sets() if case._testMethodName == "test_sets" else case.test_child_sets()
        assert "ACCELERATE_X" not in os.environ


def test_device_facts_without_gpus(monkeypatch) -> None:
    monkeypatch.setattr(device_info, "_nvml_gpu_memory", lambda: None)
    monkeypatch.setattr(device_info, "_smi", lambda query: None)
    assert get_gpu_info() == ([], 0) and check_cuda_p2p_ib_support()
    monkeypatch.setattr(
        device_info, "_nvml_gpu_memory", lambda: [("NVIDIA GeForce RTX 4090", 1, 1), ("NVIDIA A100", 1, 1)]
    )
    assert get_gpu_info() == (["NVIDIA GeForce RTX 4090", "NVIDIA A100"], 2)
    assert not check_cuda_p2p_ib_support()


def test_current_device_type_order(monkeypatch) -> None:
    order = [(d, t, lambda: False) for d, t, _ in device_info._DEVICE_ORDER]
    monkeypatch.setattr(device_info, "_DEVICE_ORDER", tuple(order))
    assert get_current_device_type() == ("cpu", "MULTI_CPU")
    order[5] = ("cuda", "MULTI_GPU", lambda: True)
    order[6] = ("xpu", "MULTI_XPU", lambda: True)
    monkeypatch.setattr(device_info, "_DEVICE_ORDER", tuple(order))
    assert get_current_device_type() == ("cuda", "MULTI_GPU")


def test_numa_affinity_needs_a_gpu(monkeypatch) -> None:
    import contextlib

    monkeypatch.setattr(device_info, "_nvml_devices", lambda: contextlib.nullcontext(None))
    with pytest.raises(RuntimeError, match="NUMA affinity needs an NVIDIA GPU 0 and its driver"):
        device_info.override_numa_affinity(0)
