"""The wrappers ``Accelerator.prepare`` hands out under DeepSpeed: the engine runs backward, the step and the scheduler.

Published as ``accelerate.utils.deepspeed.DeepSpeed{Engine,Optimizer,Scheduler}Wrapper``; they live
here, beside the optimizer and scheduler wrappers they extend, because ``utils`` may not import the
training layer. They drive any object with DeepSpeed's engine interface; building a real engine
needs ``pip install deepspeed`` (see ``DeepSpeedPlugin.require_deepspeed``).
"""

from __future__ import annotations

from typing import Any

from ..engine_stepped import EngineSteppedOptimizer, EngineSteppedScheduler

__all__ = ["DeepSpeedEngineWrapper", "DeepSpeedOptimizerWrapper", "DeepSpeedSchedulerWrapper"]


class DeepSpeedEngineWrapper:
    """Route ``accelerator.backward`` through a DeepSpeed engine, which also owns the optimizer step.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine`` returned by ``deepspeed.initialize``.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss, sync_gradients=True, **kwargs) -> None:
        """Return None after ``engine.backward(loss)``, and ``engine.step()`` at an accumulation boundary."""
        # DeepSpeed counts micro-steps itself; tell it where Accelerate's accumulation boundary is
        # so that its own gradient all-reduce happens at the same step.
        set_boundary = getattr(self.engine, "set_gradient_accumulation_boundary", None)
        if set_boundary is not None:
            set_boundary(is_boundary=sync_gradients)
        self.engine.backward(loss, **kwargs)
        if sync_gradients:
            # The engine's step() updates the weights, zeroes the gradients and steps the scheduler.
            self.engine.step()

    def get_global_grad_norm(self):
        """Return the gradient norm of the last step as a Python number (None before the first step)."""
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm


class DeepSpeedOptimizerWrapper(EngineSteppedOptimizer):
    """The optimizer view under DeepSpeed: stepping and zeroing belong to the engine, so those calls do nothing."""

    # DeepSpeed's fp16 optimizers raise their ``overflow`` flag when they skip a step; others have none.
    skip_flag = "overflow"

    def __init__(self, optimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)


class DeepSpeedSchedulerWrapper(EngineSteppedScheduler):
    """The scheduler view under DeepSpeed: the engine steps the scheduler, so ``step()`` does nothing."""
