"""How a device is spelled, in one place: device-map keys, torch devices and labels.

Three spellings meet in the big-model code, and each used to have its own helper (two pairs of them
sharing a name with different meanings):

- a **device-map key**, Accelerate's spelling in ``device_map`` values and ``max_memory`` keys: an
  int for a CUDA GPU, or ``"mps"``, ``"cpu"``, ``"disk"`` (other accelerators as torch spells them,
  ``"xpu:0"``). :func:`device_key` turns any accepted form into it, so ``0``, ``"cuda"``,
  ``"cuda:0"`` and ``torch.device("cuda", 0)`` compare equal;
- a **torch device**, where a tensor lives or a forward runs: :func:`torch_device` (an int means
  that CUDA GPU; ``"disk"`` is refused, since no tensor lives on a disk);
- a **label** shown in telemetry events, placements and reprs: :func:`device_label` (``"cuda:0"``,
  never a bare ``"cuda"``).
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = [
    "DISK",
    "GPU_LESS_KEYS",
    "OFFLOAD_KEYS",
    "Device",
    "device_key",
    "device_label",
    "is_disk",
    "machine_devices",
    "torch_device",
]

Device = Union[int, str, torch.device]
"""Anything a user may write for a device: ``0``, ``"cuda:1"``, ``"cpu"``, ``"disk"``, ``torch.device``."""

DISK = "disk"
OFFLOAD_KEYS = ("cpu", DISK)
"""Device-map keys whose weights are offloaded (loaded at each forward) when a GPU runs the model."""
GPU_LESS_KEYS = ("mps", "cpu", DISK)
"""The named (non-indexed) device-map keys, in filling order after the GPUs."""

_KEY_HELP = "use GPU indices (0, 1, ... or 'cuda:0'), 'mps', 'cpu' or 'disk'"


def device_key(device: Device) -> Union[int, str]:
    """Return ``device`` spelled as a device-map key: an int for a CUDA GPU, else ``"mps"``/``"cpu"``/``"disk"``.

    Other torch devices keep torch's spelling (``"xpu:0"``). Raises ``ValueError`` for a bool, a
    negative index or a string that names no device.
    """
    if isinstance(device, torch.device):
        if device.type == "cuda":
            return 0 if device.index is None else device.index
        return str(device)
    if isinstance(device, bool):
        raise ValueError(f"{device!r} is not a device; {_KEY_HELP}.")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"GPU index {device} is negative; use 0, 1, ...")
        return device
    if isinstance(device, str):
        text = device.strip().lower()
        if text in GPU_LESS_KEYS:
            return text
        if text.isdigit():
            return int(text)
        try:
            return device_key(torch.device(text))
        except RuntimeError:
            pass
    raise ValueError(f"Device {device!r} is not recognized: {_KEY_HELP}.")


def torch_device(device: Device) -> torch.device:
    """Return ``device`` as the ``torch.device`` a tensor can live on (an int means that CUDA GPU).

    ``"disk"`` raises ``ValueError``: weights on disk are read by offload hooks onto the CPU or a GPU.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise ValueError(f"{device!r} is not a device; {_KEY_HELP}.")
    if isinstance(device, int):
        return torch.device("cuda", device)
    if is_disk(device):
        raise ValueError(
            "'disk' is not a device a tensor can live on or compute on: offload weights there with "
            "disk_offload / offload_weight (or dispatch_model with offload_dir), and run them on 'cpu' or a GPU."
        )
    return torch.device(device)


def device_label(device: Device) -> str:
    """Return the label of ``device`` for events and reprs: ``"cuda:0"`` (never bare ``"cuda"``), ``"cpu"``, ``"disk"``."""
    if not isinstance(device, torch.device):
        if isinstance(device, int) and not isinstance(device, bool):
            return f"cuda:{device}"
        if is_disk(device):
            return DISK
        device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return "cuda:0"
    return str(device)


def is_disk(device: object) -> bool:
    """Return whether ``device`` is the ``"disk"`` device-map value."""
    return isinstance(device, str) and device == DISK


def machine_devices() -> list[str]:
    """Return the device-map values this machine can serve: its GPUs, then ``"mps"`` if present, ``"cpu"``, ``"disk"``."""
    found = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    for name in ("xpu", "npu", "mlu", "musa", "hpu", "sdaa"):
        backend = getattr(torch, name, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            found += [f"{name}:{i}" for i in range(backend.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        found.append("mps")
    return [*found, "cpu", DISK]


def check_map_device(key: str, value: object) -> None:
    """Raise ``ValueError`` naming ``key`` and ``value`` when a device-map value is no device of this machine."""
    try:
        spelled = device_key(value) if isinstance(value, (int, str, torch.device)) else None
    except ValueError:
        spelled = None
    have = machine_devices()
    if spelled is None:
        raise ValueError(
            f"device_map[{key!r}] = {value!r} is not a device; {_KEY_HELP}. This machine has: {', '.join(have)}."
        )
    label = f"cuda:{spelled}" if isinstance(spelled, int) else spelled
    if label == "meta" or label in have or label.split(":")[0] in ("cpu", DISK):
        return
    if ":" not in label and any(d.startswith(f"{label}:") for d in have):
        return  # "xpu" for "xpu:0"
    raise ValueError(
        f"device_map[{key!r}] = {value!r} names {label}, which this machine does not have. "
        f"This machine has: {', '.join(have)}."
    )
