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
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"AcceleratedScheduler wraps an object with a step() method, got {type(scheduler).__name__}"
            )
        self.scheduler = scheduler
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the wrapped schedule by as many of its steps as this optimizer step stands for."""
        if self.step_with_optimizer and not self.gradient_state.sync_gradients:
            self._count_accumulating_step()
        # Only the steps taken on behalf of every process are bounded by a fixed-length schedule
        # (OneCycleLR raises past its last step); a step the user asks for directly is not.
        bounded = self.step_with_optimizer and not self.split_batches
        for _ in range(self._schedule_steps()):
            if bounded and self._schedule_finished():
                break
            self.scheduler.step(*args, **kwargs)

    def _schedule_steps(self) -> int:
        """Return how many steps the schedule takes for this call (0 while accumulating or after a skip).

        The schedule was written for one process: each synchronised optimizer step consumed one batch
        per process, so it stands for ``num_processes`` schedule steps, or one when the batches were
        split between the processes.
        """
        if not self.step_with_optimizer:
            return 1
        if not self.gradient_state.sync_gradients or self._optimizer_skipped():
            return 0
        return 1 if self.split_batches else AcceleratorState().num_processes

    def _optimizer_skipped(self) -> bool:
        # The fp16 scaler skips a step whose gradients overflowed; the schedule waits with it.
        return any(getattr(optimizer, "step_was_skipped", False) for optimizer in self.optimizers)

    def _count_accumulating_step(self) -> None:
        # adjust_scheduler: the schedule counts accumulating micro-steps without changing the rate.
        if self.gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
            self.scheduler._step_count += 1

    def _schedule_finished(self) -> bool:
        total = getattr(self.scheduler, "total_steps", None)
        return total is not None and self.scheduler._step_count > total

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
