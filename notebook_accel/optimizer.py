"""The optimizer wrapper ``Accelerator.prepare`` returns.

It steps and zeroes only on steps where gradients are synchronised (the last micro-batch of an
accumulation window), steps through the fp16 ``GradScaler`` when there is one, and remembers
whether the scaler skipped the step (inf/NaN gradients) so the scheduler can skip too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._lazy import LazyModule, attach
from .state import AcceleratorState, GradientState
from .utils.enums import DistributedType
from .utils.imports import is_torch_xla_available
from .utils.package_checks import is_lomo_available

__all__ = ["AcceleratedOptimizer", "move_to_device", "patch_optimizer_step"]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "AcceleratorState",
    "DistributedType",
    "GradientState",
    "is_lomo_available",
    "is_torch_xla_available",
]
# The tensor operations load when an optimizer state is first moved, not with the Accelerator.
_ops = LazyModule("notebook_accel.utils.operations")
_SERVED_LAZILY = {"honor_type": "notebook_accel.utils.operations"}
__all__ += sorted(_SERVED_LAZILY)
__getattr__, __dir__ = attach(__name__, _SERVED_LAZILY)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that it follows gradient accumulation and mixed-precision scaling.

    Args:
        optimizer: the optimizer to wrap.
        device_placement: move the optimizer state to the process's device when loading a state dict.
        scaler: the ``torch.amp.GradScaler`` used for fp16, if any.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"AcceleratedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self._view_of(optimizer, device_placement, scaler)
        if device_placement and self.optimizer.state:
            # State created before prepare() (e.g. a resumed optimizer) follows the model to its device.
            self.load_state_dict(self.optimizer.state_dict())

    def _view_of(self, optimizer: Any, device_placement: bool, scaler: torch.amp.GradScaler | None) -> None:
        """Return nothing; make this object a view of ``optimizer`` (deliberately no super().__init__)."""
        self.optimizer = optimizer
        self.scaler = scaler
        self.accelerator_state = AcceleratorState()
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        self._is_overflow = False
        self._accelerate_step_called = False

    # The torch.optim.Optimizer surface, read through to the wrapped optimizer.
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: dict) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.device_placement:
            state_dict = _ops.send_to_device(state_dict, self.accelerator_state.device)
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Return nothing; clear the gradients on a synchronising step (None: the wrapped optimizer's default)."""
        # On accumulating steps the gradients must survive until the synchronising step.
        if not self.gradient_state.sync_gradients:
            return
        if set_to_none is None:
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def train(self) -> None:
        """Switch optimizers that have a train mode (schedule-free ones) to it."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Switch optimizers that have an eval mode (schedule-free ones) to it."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the wrapped optimizer on synchronising steps; return what its step returned."""
        if not self.gradient_state.sync_gradients:
            return None
        self._accelerate_step_called = True
        if self.scaler is None:
            self._is_overflow = False
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        # GradScaler lowers its scale exactly when it found inf/NaN gradients and skipped the step.
        # The scale before the step is kept as a tensor and compared when someone asks: reading it
        # (get_scale) would wait for the GPU at every step, stalling the loop.
        scale = getattr(self.scaler, "_scale", None)
        before = scale.clone() if isinstance(scale, torch.Tensor) else self.scaler.get_scale()
        result = (
            self.scaler.step(self.optimizer, closure)
            if closure is not None
            else self.scaler.step(self.optimizer)
        )
        self.scaler.update()
        self._scale_before = before
        self._is_overflow = None  # decided at the first read of step_was_skipped
        return result

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step`` was skipped by the fp16 scaler (inf or NaN gradients)."""
        if self._is_overflow is None:
            before = self._scale_before
            now = self.scaler._scale if isinstance(before, torch.Tensor) else self.scaler.get_scale()
            self._is_overflow = bool(now < before)
        return self._is_overflow

    @property
    def is_overflow(self) -> bool:
        return self.step_was_skipped

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def move_to_device(state: Any, device: int | str | torch.device) -> Any:
    """Return ``state`` (an optimizer state: nested lists/tuples/dicts) with every tensor on ``device``."""
    return _ops.send_to_device(state, device)


def patch_optimizer_step(accelerated_optimizer: AcceleratedOptimizer, method: Callable) -> Callable:
    """Return ``method`` (the wrapped optimizer's step) patched to record on ``accelerated_optimizer`` that it ran.

    A GradScaler skips ``optimizer.step`` after inf/NaN gradients; the flag
    ``accelerated_optimizer._accelerate_step_called`` tells whether the step really happened.
    """

    return _MarkingStep(accelerated_optimizer, method)


class _MarkingStep:
    """A step callable that marks its owner as stepped, then runs the real step (named and documented as it)."""

    def __init__(self, owner: AcceleratedOptimizer, step: Callable) -> None:
        self._owner = owner
        self._step = step
        functools.update_wrapper(self, step)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._owner._accelerate_step_called = True
        return self._step(*args, **kwargs)
