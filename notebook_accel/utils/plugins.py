"""Plugins passed to the Accelerator: gradient accumulation, torch.compile, tensor parallelism.

Each is a dataclass that validates its fields in ``__post_init__`` (a bad value raises ValueError
naming the field and the valid choices). Fields left at ``None`` fall back to the ``ACCELERATE_*`` /
``FSDP_*`` / ``MEGATRON_LM_*`` variables that ``accelerate launch`` exports, then to Accelerate's
defaults. The engines themselves (deepspeed, megatron-core) are imported only when used.
The engines' plugins (``DeepSpeedPlugin``, ``FullyShardedDataParallelPlugin``, ``MegatronLMPlugin``) live
with their engines in ``notebook_accel.integrations`` (``deepspeed/plugin.py``, ``fsdp/plugin.py``,
``megatron/plugin.py``), so that the process state, which imports this module, loads none of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ._kwargs_base import KwargsHandler
from ._validation import choice as _choice
from ._validation import env as _env
from ._validation import positive_int as _positive_int
from .enums import DynamoBackend
from .environment import parse_flag_from_env

__all__ = [
    "GradientAccumulationPlugin",
    "TorchDynamoPlugin",
    "TorchTensorParallelPlugin",
]

logger = logging.getLogger(__name__)


# =============================================================================================
# Gradient accumulation


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Configure gradient accumulation: ``Accelerator(gradient_accumulation_plugin=...)``.

    A KwargsHandler: ``to_dict()`` gives every field, ``to_kwargs()`` the ones changed from the defaults.
    """

    num_steps: int = None
    """Number of steps to accumulate gradients over (None: the Accelerator's own setting)."""
    adjust_scheduler: bool = True
    """Whether the learning-rate scheduler steps account for accumulation."""
    sync_with_dataloader: bool = True
    """Whether gradients are synchronised at the end of the dataloader even mid-accumulation."""
    sync_each_batch: bool = False
    """Whether gradients are synchronised on every batch (lower memory, slower under DDP)."""

    def __post_init__(self) -> None:
        if self.num_steps is not None:
            _positive_int("GradientAccumulationPlugin", "num_steps", self.num_steps)


# =============================================================================================
# torch.compile


_DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TorchDynamoPlugin:
    """Configure ``torch.compile`` for the prepared model.

    Unset fields read ``ACCELERATE_DYNAMO_BACKEND`` (default "no"), ``ACCELERATE_DYNAMO_MODE``
    (default "default"), ``ACCELERATE_DYNAMO_USE_FULLGRAPH`` and ``ACCELERATE_DYNAMO_USE_DYNAMIC``.
    """

    backend: DynamoBackend = None
    """A DynamoBackend member or its name (case-insensitive), e.g. "inductor"."""
    mode: str = None
    """One of "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"."""
    fullgraph: bool = None
    """Whether to require a single graph (no graph breaks)."""
    dynamic: bool = None
    """Whether to compile with dynamic shapes (None: torch decides)."""
    options: Any = None
    """Backend options dict (cannot be combined with a non-default ``mode``)."""
    disable: bool = False
    """Turn compilation into a no-op (debugging)."""
    use_regional_compilation: bool = None
    """Compile repeated blocks once each instead of the whole model."""

    def __post_init__(self) -> None:
        owner = "TorchDynamoPlugin"
        if self.backend is None:
            self.backend = _env("ACCELERATE_DYNAMO_BACKEND", "no")
        name = self.backend.value if isinstance(self.backend, DynamoBackend) else str(self.backend).upper()
        self.backend = DynamoBackend(_choice(owner, "backend", name, tuple(DynamoBackend.list())))
        if self.mode is None:
            self.mode = _env("ACCELERATE_DYNAMO_MODE", "default")
        _choice(owner, "mode", self.mode, _DYNAMO_MODES)
        if self.fullgraph is None:
            self.fullgraph = parse_flag_from_env("ACCELERATE_DYNAMO_USE_FULLGRAPH", False)
        if self.dynamic is None and os.environ.get("ACCELERATE_DYNAMO_USE_DYNAMIC"):
            self.dynamic = parse_flag_from_env("ACCELERATE_DYNAMO_USE_DYNAMIC")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = parse_flag_from_env(
                "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", False
            )
        if self.options is not None:
            if not isinstance(self.options, dict):
                raise TypeError(f"{owner}: options must be a dict of backend options, got {self.options!r}")
            if self.mode != "default":
                raise ValueError(
                    f"{owner}: torch.compile takes either mode or options, not both (mode={self.mode!r}, "
                    f"options={self.options!r}); leave mode unset or drop options"
                )

    def to_dict(self) -> dict[str, Any]:
        """Return the fields as plain values (backend as its lower-case torch.compile name)."""
        return {
            "backend": self.backend.value.lower(),
            "mode": self.mode,
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "options": self.options,
            "disable": self.disable,
            "use_regional_compilation": self.use_regional_compilation,
        }

    def to_kwargs(self) -> dict[str, Any]:
        """Return the ``torch.compile`` keyword arguments that differ from its defaults (as Accelerate 1.15).

        A field left at its default is omitted (``torch.compile`` applies the same value), so mode
        and options are never both passed; ``use_regional_compilation`` is ours to act on, not torch's.
        """
        return {
            name: value
            for name, value in self.to_dict().items()
            if name in _COMPILE_DEFAULTS and value != _COMPILE_DEFAULTS[name]
        }


# torch.compile's defaults, as TorchDynamoPlugin spells them ("no" is the unset backend).
_COMPILE_DEFAULTS: dict[str, Any] = {
    "backend": "no",
    "mode": "default",
    "fullgraph": False,
    "dynamic": None,
    "options": None,
    "disable": False,
}


# =============================================================================================
# Tensor parallelism


@dataclass
class TorchTensorParallelPlugin:
    """Configure tensor parallelism with torch's DTensor (``torch.distributed.tensor.parallel``).

    ``tp_size`` ranks share each layer's weights; the Accelerator builds the ``"tp"`` device mesh and
    applies the model's tensor-parallel plan (``model.tp_plan`` or ``model._tp_plan``) when it
    prepares the model. The same setting is spelled ``ParallelismConfig(tp_size=...)`` in newer code.
    """

    tp_size: int = 1
    """Number of ranks a layer is split across (1: no tensor parallelism)."""
    torch_device_mesh: Any = None
    """The ``DeviceMesh`` to split over (built by the Accelerator when None)."""

    def __post_init__(self) -> None:
        _positive_int("TorchTensorParallelPlugin", "tp_size", self.tp_size)
        if self.torch_device_mesh is not None:
            mesh_size = self.torch_device_mesh.size()
            if mesh_size != self.tp_size:
                raise ValueError(
                    f"TorchTensorParallelPlugin: torch_device_mesh has {mesh_size} ranks but tp_size={self.tp_size}; "
                    "pass a mesh of tp_size ranks or leave torch_device_mesh unset"
                )
