"""The optimizer and scheduler views an engine hands back when it steps them itself (DeepSpeed, Megatron-LM).

The training loop still calls ``optimizer.step()``, ``optimizer.zero_grad()`` and ``scheduler.step()``;
under such an engine the engine already did each inside its own step, so these views do nothing there.
An engine's wrapper subclasses them and says how it learns that a step was skipped.
"""

from __future__ import annotations

from ..optimizer import AcceleratedOptimizer
from ..scheduler import AcceleratedScheduler

__all__ = ["EngineSteppedOptimizer", "EngineSteppedScheduler"]


class EngineSteppedOptimizer(AcceleratedOptimizer):
    """An optimizer view whose engine steps and zeroes the real optimizer: ``step`` and ``zero_grad`` do nothing.

    A subclass names in ``skip_flag`` the attribute its engine's optimizer raises when it skipped a step.
    """

    skip_flag = ""

    @property
    def step_was_skipped(self) -> bool:
        """Return whether the engine skipped the last step (its optimizer's ``skip_flag`` attribute)."""
        # Read at each question: the engine raises and lowers the flag at each of its steps.
        return bool(getattr(self.optimizer, self.skip_flag, False)) if self.skip_flag else False

    def zero_grad(self, set_to_none=None) -> None:
        """Return None: the engine zeroes the gradients inside its own step."""
        return None

    def step(self) -> None:
        """Return None: the engine already ran the optimizer step."""
        return None


class EngineSteppedScheduler(AcceleratedScheduler):
    """A scheduler view whose engine advances the real scheduler: ``step`` does nothing."""

    def __init__(self, scheduler, optimizers) -> None:
        super().__init__(scheduler, optimizers)

    def step(self) -> None:
        """Return None: the engine already advanced the learning-rate schedule."""
        return None
