"""The pieces the engines share are defined once: the engine-stepped optimizer and scheduler views, the
module look-ups (``get_module_class_from_name``, ``get_module_children_bottom_up``) and activation
checkpointing for FSDP 1 and 2. Plain CPU torch: no engine is installed or needed here."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from notebook_accel.integrations.engine_stepped import EngineSteppedOptimizer, EngineSteppedScheduler
from notebook_accel.integrations.fsdp import fsdp2
from notebook_accel.integrations.fsdp.plugin import FullyShardedDataParallelPlugin
from notebook_accel.state import AcceleratorState
from notebook_accel.utils import other
from notebook_accel.utils.deepspeed import (
    DeepSpeedOptimizerWrapper,
    DeepSpeedSchedulerWrapper,
)  # Accelerate's paths
from notebook_accel.utils.megatron_lm import MegatronLMOptimizerWrapper, MegatronLMSchedulerWrapper


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(2, 2))

    def forward(self, x):
        return self.inner(x)


def test_engine_wrappers_share_one_no_op_base() -> None:
    assert issubclass(DeepSpeedOptimizerWrapper, EngineSteppedOptimizer)
    assert issubclass(MegatronLMOptimizerWrapper, EngineSteppedOptimizer)
    assert issubclass(DeepSpeedSchedulerWrapper, EngineSteppedScheduler)
    assert issubclass(MegatronLMSchedulerWrapper, EngineSteppedScheduler)
    for wrapper in (DeepSpeedOptimizerWrapper, MegatronLMOptimizerWrapper):
        assert "step" not in vars(wrapper) and "zero_grad" not in vars(wrapper)


@pytest.mark.parametrize(
    ("optimizer_view", "scheduler_view", "skip_flag"),
    [
        (DeepSpeedOptimizerWrapper, DeepSpeedSchedulerWrapper, "overflow"),
        (MegatronLMOptimizerWrapper, MegatronLMSchedulerWrapper, "skipped_iter"),
    ],
)
def test_engine_views_leave_stepping_to_the_engine(optimizer_view, scheduler_view, skip_flag) -> None:
    AcceleratorState(cpu=True)
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(torch.ones(1, 2)).sum().backward()
    before, grad = layer.weight.detach().clone(), layer.weight.grad.clone()
    view = optimizer_view(optimizer)
    view.step()
    view.zero_grad()
    assert torch.equal(layer.weight, before)  # the engine steps, not the view
    assert torch.equal(layer.weight.grad, grad)  # and the engine zeroes
    assert view.step_was_skipped is False and view.device_placement is False
    setattr(optimizer, skip_flag, True)  # read at each question, not once when wrapped
    assert view.step_was_skipped is True and optimizer_view(optimizer).step_was_skipped is True
    setattr(optimizer, skip_flag, False)
    assert view.step_was_skipped is False
    schedule = scheduler_view(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), [view])
    schedule.step()
    assert schedule.get_last_lr() == [1.0] and optimizer.param_groups[0]["lr"] == 1.0


def test_one_get_module_class_from_name_breadth_first() -> None:
    # Two different classes named "Block": the one nearest the root wins (breadth first).
    nested = type("Block", (nn.Module,), {})
    model = nn.Sequential(nn.Sequential(nested()), Block())
    assert other.get_module_class_from_name(model, "Block") is Block
    assert FullyShardedDataParallelPlugin.get_module_class_from_name(model, "Block") is Block
    assert fsdp2.get_module_children_bottom_up is other.get_module_children_bottom_up


def test_activation_checkpointing_wraps_the_selected_layers() -> None:
    model = nn.Sequential(Block(), nn.ReLU(), Block())
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        activation_checkpointing=True,
    )
    fsdp2.checkpoint_activations(model, plugin, lambda module: isinstance(module, Block))
    assert [type(m) for m in model] == [CheckpointWrapper, nn.ReLU, CheckpointWrapper]
    x = torch.randn(3, 2, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def test_activation_checkpointing_without_a_layer_selection_says_what_to_set() -> None:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True)
    with pytest.raises(ValueError, match=r"activation_checkpointing needs.*transformer_based_wrap"):
        fsdp2.checkpoint_activations(nn.Linear(2, 2), plugin, None)
