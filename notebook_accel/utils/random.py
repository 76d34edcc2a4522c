"""Seeding and synchronising random number generators across processes."""

from __future__ import annotations

import random as _py_random
import sys
from collections.abc import Iterable

import numpy as np
import torch

from .._lazy import attach
from .constants import CUDA_DISTRIBUTED_TYPES
from .enums import DistributedType, RNGType
from .environment import _process_index
from .imports import (
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xpu_available,
)

__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "CUDA_DISTRIBUTED_TYPES",
    "DistributedType",
    "is_hpu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_sdaa_available",
    "is_torch_xla_available",
    "is_xpu_available",
]
_REEXPORTED_LAZILY = {"AcceleratorState": "notebook_accel.state"}
__all__ += sorted(_REEXPORTED_LAZILY)
__getattr__, __dir__ = attach(__name__, _REEXPORTED_LAZILY)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Return nothing; seed ``random``, ``numpy`` and ``torch`` (every device) for reproducible runs.

    With ``device_specific`` the seed is offset by the process index, so each rank draws different
    numbers. With ``deterministic`` torch is told to use deterministic algorithms only.
    CUDA generators are seeded lazily (applied when CUDA initialises), so this never initialises CUDA.

    Args:
        seed: The seed.
        device_specific: Add the process index to the seed, so each rank draws differently.
        deterministic: Make torch use deterministic algorithms only.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    seed = int(seed)
    if device_specific:
        seed += _process_index()
    if not 0 <= seed < 2**32:
        # numpy's legacy seeding only takes 32-bit seeds; refuse instead of wrapping silently.
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    _py_random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also queues the seed for every CUDA device, lazily
    torch.cuda.manual_seed_all(seed)
    for name in ("xpu", "npu", "mlu", "musa", "hpu"):
        backend = getattr(torch, name, None)
        if backend is not None and hasattr(backend, "manual_seed_all") and backend.is_available():
            backend.manual_seed_all(seed)
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _get_state(rng_type: RNGType, generator: torch.Generator | None) -> torch.Tensor:
    if rng_type == RNGType.TORCH:
        return torch.get_rng_state()
    if rng_type == RNGType.CUDA:
        return torch.cuda.get_rng_state()
    if rng_type == RNGType.GENERATOR:
        return generator.get_state()
    if rng_type == RNGType.XLA:
        import torch_xla.core.xla_model as xm

        return torch.tensor(xm.get_rng_state())
    backend = getattr(torch, rng_type.value, None)
    if backend is None or not hasattr(backend, "get_rng_state"):
        raise ValueError(f"RNG type {rng_type.value!r} is not available in this torch build")
    return backend.get_rng_state()


def _set_state(rng_type: RNGType, generator: torch.Generator | None, state: torch.Tensor) -> None:
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(state)
    elif rng_type == RNGType.CUDA:
        torch.cuda.set_rng_state(state)
    elif rng_type == RNGType.GENERATOR:
        generator.set_state(state)
    elif rng_type == RNGType.XLA:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state.item()))
    else:
        getattr(torch, rng_type.value).set_rng_state(state)


def synchronize_rng_state(rng_type: RNGType | None = None, generator: torch.Generator | None = None) -> None:
    """Return nothing; give every process the RNG state of process 0 (no-op without a process group).

    ``rng_type`` is an RNGType (or its value): "torch" (the default), "cuda", "xla", "npu", "xpu",
    ... or "generator", which needs ``generator``.
    """
    if rng_type is None:
        rng_type = RNGType.TORCH
    if rng_type not in RNGType:
        raise ValueError(f"rng_type={rng_type!r} is not valid; choose one of {RNGType.list()}")
    rng_type = RNGType(rng_type)
    if rng_type == RNGType.GENERATOR and generator is None:
        raise ValueError("rng_type='generator' needs the torch.Generator to synchronise: pass generator=...")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    state = _get_state(rng_type, generator)
    if dist.get_backend() == "nccl":
        # NCCL only moves device tensors.
        device = torch.device("cuda", torch.cuda.current_device())
        shipped = state.to(device)
        dist.broadcast(shipped, src=0)
        state = shipped.cpu()
    else:
        dist.broadcast(state, src=0)
    _set_state(rng_type, generator, state)


def synchronize_rng_states(rng_types: list[str | RNGType], generator: torch.Generator | None = None) -> None:
    """Return nothing; synchronise each RNG named in ``rng_types`` with process 0's state."""
    if isinstance(rng_types, (str, RNGType)) or not isinstance(rng_types, Iterable):
        raise TypeError(
            f"rng_types must be a list of RNG types such as ['torch', 'generator'], got {rng_types!r}"
        )
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
