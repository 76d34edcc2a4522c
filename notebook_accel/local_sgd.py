"""Local SGD: each process takes ``local_sgd_steps`` optimizer steps on its own, then the weights are averaged.

Gradients are not all-reduced inside the ``with LocalSGD(...)`` block (the model runs under
``accelerator.no_sync``); every ``local_sgd_steps`` calls of ``step()``, and when the block ends,
every parameter is replaced by its mean over the processes. For data parallelism over plain
processes (CPU or GPU), not DeepSpeed, FSDP or model parallelism.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from ._lazy import attach
from .utils.enums import DistributedType


class _SyncingAccelerator(Protocol):
    """What LocalSGD uses of the Accelerator: its distributed type and four collective-minded verbs."""

    @property
    def distributed_type(self) -> DistributedType:
        """How the run is distributed."""

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes do not synchronise the gradients of ``model``."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run the backward pass of ``loss``."""

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """Return ``tensor`` reduced across the processes."""


__all__ = ["DistributedType", "LocalSGD"]
# The Accelerator sits above this module (it is only driven here); Accelerate serves the name here too.
_REEXPORTED_LAZILY = {"Accelerator": "notebook_accel.accelerator"}
__all__ += sorted(_REEXPORTED_LAZILY)
__getattr__, __dir__ = attach(__name__, _REEXPORTED_LAZILY)

# Where averaging whole parameters across processes is what data parallelism means.
_SUPPORTED = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_NEURON,
)


class LocalSGD:
    """A context manager running local SGD over ``model`` with ``accelerator``.

    ``local_sgd_steps`` optimizer steps run locally between two averagings; ``enabled=False`` makes
    the whole helper a no-op (ordinary synchronous data parallelism).

    Example::

        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in loader:
                loss = model(batch).sum()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
    """

    def __init__(
        self,
        accelerator: _SyncingAccelerator,
        model: torch.nn.Module,
        local_sgd_steps: int,
        enabled: bool = True,
    ) -> None:
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ValueError(f"LocalSGD: local_sgd_steps must be a positive int, got {local_sgd_steps!r}")
        distributed_type = accelerator.distributed_type
        if enabled and distributed_type not in _SUPPORTED:
            raise ValueError(
                f"LocalSGD averages whole parameters across processes and does not run under {distributed_type}: "
                "use plain data parallelism (no DeepSpeed, FSDP, Megatron-LM or TP), or enabled=False"
            )
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and distributed_type != DistributedType.NO
        self.num_steps = 0
        self._no_sync: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.enabled and self._no_sync is not None:
            # Leave every process with the same weights, whatever step the loop stopped at.
            if exc_type is None:
                self._sync_and_avg_model_params()
            self._no_sync.__exit__(exc_type, exc_value, traceback)
            self._no_sync = None

    def step(self) -> None:
        """Count one optimizer step; every ``local_sgd_steps`` of them, average the weights across processes."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_(self.accelerator.reduce(param.detach(), reduction="mean"))
