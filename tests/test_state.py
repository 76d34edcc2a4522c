"""State singletons in a single process: defaults, sharing, reset, validation, GradientState bookkeeping."""

from __future__ import annotations

import collections
import types

import numpy as np
import pytest
import torch

from notebook_accel import AcceleratorState, DistributedType, PartialState
from notebook_accel.state import GradientState
from notebook_accel.state.split import share_bounds, take_share
from notebook_accel.utils import (
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    MegatronLMPlugin,
    TorchDynamoPlugin,
)
from notebook_accel.utils.imports import is_cuda_available, is_mps_available

_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for name in (*_WORLD_VARS, "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU", "ACCELERATE_DEBUG_MODE"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_single_process_defaults():
    state = PartialState()
    assert state.distributed_type == DistributedType.NO
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    expected = "cuda" if is_cuda_available() else "mps" if is_mps_available() else "cpu"
    assert state.device.type == expected
    assert state.mixed_precision == "no"
    assert state.debug is False
    assert state.use_distributed is False
    assert state.initialized
    assert state.backend is None
    assert repr(state).startswith(
        "Distributed environment: DistributedType.NO\nNum processes: 1\nProcess index: 0\n"
    )
    assert f"Device: {state.device}" in repr(state)


def test_instances_share_state_and_reset_forgets_it(monkeypatch):
    first, second = PartialState(), PartialState()
    first.custom_flag = 42
    assert second.custom_flag == 42
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    assert PartialState().debug is False  # the environment is read once
    PartialState._reset_state()
    assert not first.initialized
    with pytest.raises(
        AttributeError,
        match=r"^`PartialState` object has no attribute `process_index`\. This happens if `PartialState\._reset_state\(\)` was called",
    ):
        _ = first.process_index
    fresh = PartialState()
    assert fresh.debug is True and first.debug is True
    assert not hasattr(fresh, "custom_flag")
    with pytest.raises(AttributeError, match="object has no attribute 'missing'"):
        _ = fresh.missing


def test_shared_state_dicts_are_empty_after_reset_and_filled_once_a_state_exists():
    """As 1.15's: its tracker tests reset the process state alone, build a tracker, then an Accelerator."""
    from notebook_accel import Accelerator

    assert PartialState._shared_state == {} and AcceleratorState._shared_state == {}
    Accelerator(cpu=True)
    assert PartialState._shared_state != {} and AcceleratorState._shared_state != {}
    PartialState._reset_state()
    assert PartialState._shared_state == {} and AcceleratorState._shared_state != {}
    accelerator = Accelerator(cpu=True)
    assert PartialState._shared_state["num_processes"] == 1
    assert PartialState().device == accelerator.device
    AcceleratorState._reset_state(reset_partial_state=True)
    assert PartialState._shared_state == {} and AcceleratorState._shared_state == {}
    assert PartialState()._shared_state is PartialState._shared_state != {}



@pytest.mark.parametrize("how", ["argument", "env"])
def test_cpu_forced(monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
        state = PartialState()
    else:
        state = PartialState(cpu=True)
    assert state.device == torch.device("cpu")
    assert state.use_cpu is True
    assert state.default_device == torch.device("cpu")


def test_mixed_precision_from_env_and_bad_value(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "BF16")
    assert PartialState().mixed_precision == "bf16"
    PartialState._reset_state()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp32")
    with pytest.raises(ValueError, match=r"ACCELERATE_MIXED_PRECISION 'fp32'.*'no', 'fp16', 'bf16', 'fp8'"):
        PartialState()


def test_bad_flag_in_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "maybe")
    with pytest.raises(ValueError, match="ACCELERATE_DEBUG_MODE='maybe'"):
        PartialState()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
        ({"WORLD_SIZE": "2"}, r"needs RANK in \[0, 1\], got RANK=None"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, r"needs RANK in \[0, 1\], got RANK='2'"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR and MASTER_PORT are not set"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
    ],
)
def test_bad_world_environment(monkeypatch, env, match):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        PartialState()
    assert not PartialState._shared_state  # nothing half-initialised


@pytest.mark.skipif(is_cuda_available(), reason="checks the error raised without CUDA")
def test_nccl_backend_without_cuda(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match="backend 'nccl' needs CUDA devices.*backend='gloo' or cpu=True"):
        PartialState(backend="nccl")


def test_more_local_ranks_than_gpus(monkeypatch):
    import notebook_accel.utils.imports as imports

    monkeypatch.setattr(imports, "cuda_device_count", lambda: 1)
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 but only 1 CUDA device\(s\).*cpu=True"):
        PartialState()


def test_process_control_in_one_process(capsys):
    state = PartialState()
    calls = []

    @state.on_main_process
    def main(x):
        calls.append(("main", x))
        return x

    @state.on_local_main_process
    def local_main():
        calls.append("local")

    @state.on_last_process
    def last():
        calls.append("last")

    @state.on_process(process_index=0)
    def zero():
        calls.append("p0")

    @state.on_process(process_index=1)
    def one():
        calls.append("p1")

    @state.on_local_process(local_process_index=0)
    def local_zero():
        calls.append("l0")

    assert main(3) == 3 and main.__name__ == "main"
    local_main(), last(), zero(), one(), local_zero()
    state.on_process(lambda: calls.append("direct"), process_index=0)()
    state.on_process(0)(lambda: calls.append("positional"))()
    assert calls == [("main", 3), "local", "last", "p0", "l0", "direct", "positional"]
    with state.main_process_first():
        calls.append("first")
    with state.local_main_process_first():
        calls.append("local first")
    state.wait_for_everyone()
    state.set_device()
    state.destroy_process_group()
    state.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
    assert state.use_ipex is False


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.on_process(lambda: None), "process_index is required"),
        (
            lambda s: s.on_local_process(lambda: None),
            r"local_process_index is required: use @state.on_local_process\(local_process_index=0\)",
        ),
        (lambda s: s.on_process(process_index=-1), "process_index must be a non-negative int, got -1"),
        (lambda s: s.on_local_process(local_process_index="0"), "must be a non-negative int, got '0'"),
    ],
)
def test_on_process_bad_index(call, match):
    with pytest.raises(ValueError, match=match):
        call(PartialState())


def test_split_in_one_process_yields_input():
    data = ["A", "B", "C"]
    with PartialState().split_between_processes(data, apply_padding=True) as part:
        assert part is data


def test_split_shares():
    shares = [take_share(["A", "B", "C"], 2, r) for r in range(2)]
    assert shares == [["A", "B"], ["C"]]
    assert [take_share(["A", "B", "C"], 2, r, apply_padding=True) for r in range(2)] == [
        ["A", "B"],
        ["C", "C"],
    ]
    assert [take_share(("A", "B", "C"), 2, r, True) for r in range(2)] == [("A", "B"), ("C", "C")]
    assert [take_share(list(range(5)), 4, r, True) for r in range(4)] == [[0, 1], [2, 2], [3, 3], [4, 4]]
    assert [take_share(["A"], 3, r) for r in range(3)] == [["A"], [], []]
    assert [take_share(["A"], 3, r, True) for r in range(3)] == [["A"], ["A"], ["A"]]
    t = torch.arange(10).reshape(5, 2)
    assert torch.equal(take_share(t, 2, 1, True), torch.tensor([[6, 7], [8, 9], [8, 9]]))
    arr = np.arange(5)
    assert take_share(arr, 2, 1, True).tolist() == [3, 4, 4]
    d = take_share({"a": [1, 2, 3], "b": torch.tensor([4, 5, 6])}, 2, 1, True)
    assert d["a"] == [3, 3] and d["b"].tolist() == [6, 6]
    # The mapping keeps its type, also one whose constructor is not dict-like.
    ordered = take_share(collections.OrderedDict(a=[1, 2, 3]), 2, 0)
    assert type(ordered) is collections.OrderedDict and ordered["a"] == [1, 2]
    grouped = take_share(collections.defaultdict(list, a=[1, 2, 3]), 2, 1)
    assert (
        type(grouped) is collections.defaultdict and grouped["a"] == [3] and grouped.default_factory is list
    )
    assert share_bounds(7, 3, 0) == (0, 3, 3) and share_bounds(7, 3, 2) == (5, 7, 3)


def test_split_dataset_like_object():
    class FakeDataset:
        column_names = ["x"]

        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def select(self, indices):
            return FakeDataset([self.rows[i] for i in indices])

    assert take_share(FakeDataset([1, 2, 3]), 2, 1, True).rows == [3, 3]


@pytest.mark.parametrize(
    ("inputs", "padding", "error", "match"),
    [
        ({"a": [1, 2], "b": [1]}, False, ValueError, r"same length, got \{'a': 2, 'b': 1\}"),
        (42, False, TypeError, "cannot split a int"),
        ("abc", False, TypeError, "cannot split a str"),
        ({1, 2}, False, TypeError, "cannot split a set"),
        ([], True, ValueError, "cannot pad empty inputs"),
        ({"a": []}, True, ValueError, "cannot pad empty inputs"),
    ],
)
def test_split_bad_inputs(inputs, padding, error, match):
    with pytest.raises(error, match=match):
        take_share(inputs, 2, 0, padding)


def test_accelerator_state_defaults_and_mixed_precision(monkeypatch):
    state = AcceleratorState(mixed_precision="fp16")
    assert state.initialized and state.mixed_precision == "fp16"
    assert state.distributed_type == DistributedType.NO and state.num_processes == 1
    assert isinstance(state.dynamo_plugin, TorchDynamoPlugin)
    assert state.deepspeed_plugins == {} and state.deepspeed_plugin is None
    assert state.fsdp_plugin is None and state.megatron_lm_plugin is None and state.parallelism_config is None
    assert repr(state).endswith(f"Device: {state.device}\nMixed precision type: fp16\n")
    assert AcceleratorState().mixed_precision == "fp16"  # shared
    assert AcceleratorState(mixed_precision="fp16").mixed_precision == "fp16"
    with pytest.raises(
        ValueError, match="already initialised with mixed_precision='fp16', cannot switch to 'bf16'"
    ):
        AcceleratorState(mixed_precision="bf16")
    AcceleratorState._reset_state()
    assert not state.initialized
    assert AcceleratorState().initialized and state.mixed_precision == "no"
    AcceleratorState._reset_state()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert AcceleratorState().mixed_precision == "no"  # PartialState kept its environment
    AcceleratorState._reset_state(reset_partial_state=True)
    assert AcceleratorState().mixed_precision == "bf16"


def test_accelerator_state_bad_mixed_precision():
    with pytest.raises(
        ValueError, match=r"Unknown mixed_precision 'fp32': choose one of 'no', 'fp16', 'bf16', 'fp8'"
    ):
        AcceleratorState(mixed_precision="fp32")
    assert not AcceleratorState._shared_state


def test_accelerator_state_plugins():
    first, second = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=3)
    state = AcceleratorState(deepspeed_plugin={"first": first, "second": second})
    assert state.distributed_type == DistributedType.DEEPSPEED
    assert state.get_deepspeed_plugin("second") is second
    assert state.deepspeed_plugin is first
    state.select_deepspeed_plugin("second")
    assert state.deepspeed_plugin is second and first.selected is False
    state.select_deepspeed_plugin()
    assert state.deepspeed_plugin is first
    with pytest.raises(
        ValueError, match=r"No DeepSpeed plugin named 'third': registered names are \['first', 'second'\]"
    ):
        state.get_deepspeed_plugin("third")
    assert PartialState().distributed_type == DistributedType.NO  # the process world is unchanged

    AcceleratorState._reset_state()
    fsdp = FullyShardedDataParallelPlugin()
    state = AcceleratorState(fsdp_plugin=fsdp, parallelism_config={"dp": 1})
    assert state.distributed_type == DistributedType.FSDP and state.fsdp_plugin is fsdp and not state.is_fsdp2
    assert state.parallelism_config == {"dp": 1}
    AcceleratorState._reset_state()
    state = AcceleratorState(megatron_lm_plugin=MegatronLMPlugin())
    assert state.distributed_type == DistributedType.MEGATRON_LM
    with pytest.raises(ValueError, match="No DeepSpeed plugin is registered"):
        state.select_deepspeed_plugin()
    AcceleratorState._reset_state()
    with pytest.raises(ValueError, match="deepspeed_plugin is an empty dict"):
        AcceleratorState(deepspeed_plugin={})
    single = DeepSpeedPlugin()
    assert AcceleratorState(deepspeed_plugin=single).get_deepspeed_plugin("default") is single


def test_accelerator_state_methods_delegate():
    state = AcceleratorState()
    with state.split_between_processes([1, 2]) as part:
        assert part == [1, 2]
    with state.main_process_first():
        pass
    assert state.on_main_process(lambda: 5)() == 5
    state.wait_for_everyone()
    state.destroy_process_group()
    assert state.is_main_process and state.is_last_process and state.use_ipex is False


def test_gradient_state_defaults_and_plugin():
    state = GradientState()
    assert state.initialized and state.sync_gradients is True
    assert state.active_dataloader is None and state.dataloader_references == [None]
    assert state.in_dataloader is False and state.end_of_dataloader is False and state.remainder == -1
    assert (state.num_steps, state.adjust_scheduler, state.sync_with_dataloader) == (1, False, True)
    assert state.plugin_kwargs == {} and state.is_xla_gradients_synced is False
    GradientState(GradientAccumulationPlugin(num_steps=4, adjust_scheduler=False, sync_with_dataloader=False))
    assert (state.num_steps, state.adjust_scheduler, state.sync_with_dataloader) == (4, False, False)
    GradientState(GradientAccumulationPlugin(num_steps=2))
    assert (state.num_steps, state.adjust_scheduler, state.sync_each_batch) == (2, True, False)
    assert repr(state).startswith(
        "GradientState(sync_gradients=True, num_steps=2, in_dataloader=False, end_of_dataloader=False, "
        "remainder=-1, plugin_kwargs={'num_steps': 2, 'adjust_scheduler': True"
    )
    with pytest.raises(TypeError, match="must be a GradientAccumulationPlugin, got int"):
        GradientState(3)
    GradientState._reset_state()
    assert GradientState().num_steps == 1
    # Without a plugin there are no plugin fields to show.
    assert repr(GradientState()) == (
        "GradientState(sync_gradients=True, num_steps=1, in_dataloader=False, end_of_dataloader=False, remainder=-1)"
    )


def test_gradient_state_dataloader_bookkeeping(monkeypatch):
    state = GradientState()
    outer, inner = object(), types.SimpleNamespace(end_of_dataloader=False, remainder=-1)
    state._add_dataloader(outer)
    assert state.active_dataloader is outer and state.in_dataloader
    state._set_end_of_dataloader(True)
    state._set_remainder(3)
    assert state.end_of_dataloader is True and state.remainder == 3
    state._add_dataloader(inner)
    assert state.dataloader_references == [None, outer, inner]
    assert state.end_of_dataloader is False and state.remainder == -1
    inner.end_of_dataloader, inner.remainder = True, 5  # a dataloader may keep the flags itself
    assert state.end_of_dataloader is True and state.remainder == 5
    state._set_end_of_dataloader(False)
    assert inner.end_of_dataloader is False
    state._remove_dataloader(inner)
    assert state.active_dataloader is outer and state.dataloader_references == [None, outer]
    state._remove_dataloader(outer)
    assert state.active_dataloader is None and not state.in_dataloader and state.end_of_dataloader is False
    state._set_sync_gradients(False)
    assert GradientState().sync_gradients is False
    state.is_xla_gradients_synced = True
    assert state.is_xla_gradients_synced is True
    state.is_xla_gradients_synced = False
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert state.is_xla_gradients_synced is True


@pytest.mark.cuda
@pytest.mark.skipif(not is_cuda_available(), reason="only meaningful where CUDA could be initialised")
def test_import_does_not_initialise_cuda():
    import subprocess
    import sys

    code = "import notebook_accel as a, torch; a.PartialState(); print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_init_process_group_kwargs_are_passed_through(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    from notebook_accel.utils import InitProcessGroupKwargs

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    env = {
        "WORLD_SIZE": "4",
        "RANK": "3",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    kwargs = InitProcessGroupKwargs(timeout=timedelta(seconds=77)).to_kwargs()
    state = PartialState(cpu=True, **kwargs)
    assert calls == [{"backend": "gloo", "timeout": timedelta(seconds=77), "rank": 3, "world_size": 4}]
    assert state.distributed_type == DistributedType.MULTI_CPU and state.backend == "gloo"
    assert (state.num_processes, state.process_index, state.local_process_index) == (4, 3, 1)
    assert state.is_last_process and not state.is_main_process and not state.is_local_main_process
    PartialState._reset_state()
    PartialState(cpu=True, backend="gloo", init_method="tcp://127.0.0.1:1")
    assert calls[-1]["init_method"] == "tcp://127.0.0.1:1" and calls[-1]["backend"] == "gloo"
