"""What ``prepare()`` stamps on the objects it returns, and the checks made before preparing a model again.

Accelerate 1.15 flags every prepared object with ``_is_accelerate_prepared``; libraries read the flag
to tell a prepared object from a raw one, and ``prepare()`` passes such an object through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PREPARED_FLAG"]


# What Accelerate 1.15 stamps on everything prepare() gives back; libraries read it to tell a
# prepared object from a raw one, and prepare() passes such an object through unchanged.
PREPARED_FLAG = "_is_accelerate_prepared"


def _mark_prepared(obj: Any) -> Any:
    """Return ``obj`` flagged as prepared (when it takes attributes)."""
    try:
        setattr(obj, PREPARED_FLAG, True)
    except (AttributeError, TypeError):
        pass
    return obj


def _reuse_prepared(registry: list[Any], obj: Any) -> bool:
    """Return whether ``obj`` was prepared already; such an object joins ``registry`` once, by identity."""
    if not getattr(obj, PREPARED_FLAG, False):
        return False
    if not any(known is obj for known in registry):
        registry.append(obj)
    return True


def _quantized_placement(model: torch.nn.Module) -> bool:
    """Return whether ``model`` is a bitsandbytes 8/4-bit model already placed by its ``hf_device_map``.

    Raises ValueError when that map offloads part of it to the CPU or disk, which cannot be trained.
    """
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    device_map = getattr(model, "hf_device_map", None)
    if not quantized or not isinstance(device_map, dict):
        return False
    offloaded = sorted({str(d) for d in device_map.values() if str(d) in ("cpu", "disk")})
    if offloaded:
        raise ValueError(
            "You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk "
            f"offload: its hf_device_map puts modules on {' and '.join(offloaded)}. Load it with a "
            "device_map on accelerators only (e.g. device_map={'': 0}), or without load_in_8bit/4bit."
        )
    return True
