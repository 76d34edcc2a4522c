"""Typing protocols for the objects the low layers are handed but may not import.

The engine helpers in ``utils`` (FSDP, FSDP2, Megatron-LM) take the Accelerator as their first argument,
as Accelerate's do, but ``utils`` sits below ``accelerator``: they are typed against
:class:`AcceleratorLike`, the few members they read, so any object with those members (a test's
stand-in included) serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .enums import DistributedType

__all__ = ["AcceleratorLike"]


class AcceleratorLike(Protocol):
    """What the engine helpers read from an ``Accelerator``."""

    @property
    def state(self) -> Any:
        """The ``AcceleratorState``: its ``fsdp_plugin``, ``megatron_lm_plugin`` and ``device``."""

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""

    @property
    def distributed_type(self) -> DistributedType:
        """How the run is distributed (``DistributedType.FSDP``, ``MULTI_GPU``...)."""

    @property
    def num_processes(self) -> int:
        """How many processes take part in the run."""

    @property
    def mixed_precision(self) -> str:
        """The mixed-precision mode: "no", "fp16", "bf16" or "fp8"."""
