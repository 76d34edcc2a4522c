"""The learning-rate scheduler wrapper ``Accelerator.prepare`` returns.

A schedule written for single-process training counts batches; once the data is sharded each
optimizer step consumes ``num_processes`` of those batches, so the wrapper advances the schedule
``num_processes`` times per step (once with ``split_batches``). It does not advance on accumulating
steps (unless ``GradientState.adjust_scheduler`` asks it to count them) nor when the fp16 scaler
skipped the optimizer step.
"""

from __future__ import annotations

from typing import Any

from .state import AcceleratorState, GradientState

__all__ = ["AcceleratedScheduler"]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += ["AcceleratorState", "GradientState"]


class AcceleratedScheduler:
    """Wrap ``scheduler`` so that it steps in time with the prepared optimizers.

    Args:
        scheduler: the learning-rate scheduler.
        optimizers: the prepared optimizer(s) the scheduler follows.
        step_with_optimizer: step only when the optimizers actually stepped.
        split_batches: batches are split between processes (one schedule step per optimizer step).
    """

    def __init__(
        self, scheduler: Any, optimizers: Any, step_with_optimizer: bool = True, split_batches: bool = False
    ):
        from .state import GradientState

        if not hasattr(scheduler, "step"):
            raise TypeError(
                f"AcceleratedScheduler wraps an object with a step() method, got {type(scheduler).__name__}"
            )
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        if self.split_batches:
            self.scheduler.step(*args, **kwargs)
            return
        from .state import AcceleratorState

        total_steps = getattr(self.scheduler, "total_steps", None)
        for _ in range(AcceleratorState().num_processes):
            # OneCycleLR raises past its last step; the extra per-process steps stop there.
            if total_steps is not None and self.scheduler._step_count > total_steps:
                break
            self.scheduler.step(*args, **kwargs)

    # Read-through of the scheduler API.
    def get_last_lr(self) -> list[float]:
        """Return the learning rates the scheduler set last."""
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped scheduler's state dict."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> list[float]:
        """Return the learning rates the scheduler computes for the current step."""
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
