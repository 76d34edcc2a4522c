"""What DeviceMapExplorer accepts as controls: budgets, dtypes and device order, each checked with the way out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from notebook_accel.utils.device_planning.sizes import convert_file_size_to_int

__all__ = ["DTYPES", "check_dtype", "check_max_memory", "check_streaming_budget", "device_order"]

DTYPES = (None, "float32", "float16", "bfloat16", "int8")


def device_order(device: Any) -> tuple[int, str]:
    """Return the sort key of a device: GPUs by index, then other accelerators, "cpu", "disk"."""
    if isinstance(device, int):
        return (0, f"{device:06d}")
    if device == "cpu":
        return (2, "")
    if device == "disk":
        return (3, "")
    return (1, str(device))


def check_max_memory(max_memory: Mapping[int | str, int | str]) -> dict[int | str, int]:
    """Return ``max_memory`` in bytes, in device order; raise ValueError naming a bad key or value."""
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(
            f"max_memory must be a non-empty dict like {{0: '10GiB', 'cpu': '30GiB'}}, got {max_memory!r}"
        )
    out: dict[int | str, int] = {}
    for key, value in max_memory.items():
        if key == "disk":
            raise ValueError(
                "max_memory cannot budget 'disk': disk is the unlimited last resort of a device map"
            )
        if not (isinstance(key, int) or isinstance(key, str)):
            raise ValueError(f"max_memory key {key!r} is not a device: use a GPU index (0, 1...) or 'cpu'")
        out[key] = convert_file_size_to_int(value) if isinstance(value, str) else int(value)
        if out[key] < 0:
            raise ValueError(f"max_memory[{key!r}] is negative ({value!r})")
    return dict(sorted(out.items(), key=lambda kv: device_order(kv[0])))


def check_dtype(dtype: str | torch.dtype | None) -> str | None:
    """Return ``dtype`` spelled as in ``DTYPES``; raise ValueError for another one."""
    if dtype is None:
        return None
    text = str(dtype).replace("torch.", "")
    if text not in DTYPES:
        raise ValueError(f"Unsupported dtype {dtype!r} for a device map: choose one of {list(DTYPES)}")
    return text


def check_streaming_budget(budget: int | str | None) -> int:
    """Return the streaming budget in bytes (0 for None); raise ValueError for a negative or unreadable one."""
    if budget is None:
        return 0
    try:
        nbytes = convert_file_size_to_int(budget)
    except (TypeError, ValueError):
        nbytes = -1
    if nbytes < 0:
        raise ValueError(
            f"streaming_budget={budget!r} is not a size: give the bytes the first GPU keeps free for the weights "
            "streamed ahead (an int >= 0 or text like '1GiB'), or None"
        )
    return nbytes
