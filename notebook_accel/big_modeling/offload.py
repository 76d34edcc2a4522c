"""Offloading a whole model: to one CPU state dict (``cpu_offload``), to memory-mapped files
(``disk_offload``), or to the CPU between uses in a pipeline (``cpu_offload_with_hook``).

Each weight is loaded at its module's forward by an ``AlignDevicesHook`` and released after; the
prefetcher loads the next block while the current one computes. On a CUDA execution device the
weights are streamed: pinned once here, copied on a side stream as far ahead as ``lookahead``
allows (:mod:`notebook_accel.hooks.streaming`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..hooks import (
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    add_hook_to_module,
    attach_align_device_hook,
)
from ..hooks.prefetch import enable_prefetch
from ..utils.offload import INDEX_NAME, OffloadedWeightsLoader, offload_state_dict

__all__ = [
    "check_no_meta",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "has_offload_index",
    "start_prefetch",
]


def _first_device(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    if param is None or param.device.type == "meta":
        return torch.device("cpu")
    return param.device


def start_prefetch(
    model: nn.Module,
    prefetch: bool | int,
    *,
    lookahead: int | str | None = None,
    pin_memory: bool | int | str = True,
    blocks: list[str] | None = None,
    owned: bool = False,
) -> None:
    """Serve the offloading hooks of ``model`` with a prefetcher (``prefetch``: False, True or a depth).

    The keywords are :func:`~notebook_accel.hooks.prefetch.enable_prefetch`'s streaming options.
    """
    if not isinstance(prefetch, (bool, int)) or (
        prefetch is not True and prefetch is not False and prefetch < 1
    ):
        raise ValueError(f"prefetch={prefetch!r}: give True, False or how many blocks ahead (an int >= 1)")
    if prefetch:
        depth = None if prefetch is True else int(prefetch)
        enable_prefetch(model, depth, lookahead=lookahead, pin_memory=pin_memory, blocks=blocks, owned=owned)


def _offload_whole_model(
    model: nn.Module,
    execution_device: torch.device | None,
    weights_map: Any,
    offload_buffers: bool,
    preload_module_classes: list[str] | None,
    prefetch: bool | int,
    streaming: dict[str, Any],
) -> nn.Module:
    """Return ``model`` hooked to load every weight from ``weights_map`` at its module's forward.

    Shared by :func:`cpu_offload` and :func:`disk_offload`; ``execution_device`` defaults to the
    device of the model's first parameter.
    """
    if execution_device is None:
        execution_device = _first_device(model)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device=execution_device,
        offload=True,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        preload_module_classes=preload_module_classes,
    )
    start_prefetch(model, prefetch, **streaming)
    return model


def cpu_offload(
    model: nn.Module,
    execution_device: torch.device | None = None,
    offload_buffers: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
    *,
    prefetch: bool | int = True,
    lookahead: int | str | None = None,
    pin_memory: bool | int | str = True,
) -> nn.Module:
    """Return ``model`` with all its weights offloaded to one CPU state dict, loaded per module at its forward.

    ``execution_device`` defaults to the device of the model's first parameter. On a CUDA device the
    weights are streamed (pinned once, copied ahead on a side stream; see the big-model guide).

    Args:
        model: The model to offload.
        execution_device: Where each module computes (default: the device of the first parameter).
        offload_buffers: Offload the buffers too (default: they stay on the execution device).
        state_dict: The weights to serve (default: the model's own).
        preload_module_classes: Classes whose whole subtree is loaded at their own forward.
        prefetch: Load weights ahead of time: True (default), False, or how many modules ahead.
        lookahead: CUDA: GPU bytes (or text like "2GiB") for the weights copied ahead (default: three
            modules' worth and at least 256 MiB, within half the free memory).
        pin_memory: CUDA: pin the offloaded weights once (True), not at all (False), or up to a size.
    """
    owned = state_dict is None
    if state_dict is None:
        state_dict = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
    streaming = {"lookahead": lookahead, "pin_memory": pin_memory, "owned": owned}
    return _offload_whole_model(
        model, execution_device, state_dict, offload_buffers, preload_module_classes, prefetch, streaming
    )


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: int | str | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Return ``(model, hook)``: the model moves to ``execution_device`` at its forward and stays there until ``hook.offload()``.

    ``prev_module_hook`` (the hook of the previous model of a pipeline) is offloaded just before
    this model runs. The default device is MPS, else GPU 0, else the CPU.

    Args:
        model: The model to move in and out.
        execution_device: Where it runs (default: MPS, else GPU 0, else the CPU).
        prev_module_hook: The hook of the model that runs before this one; it is offloaded when this one
            starts.
    """
    if prev_module_hook is not None and not isinstance(prev_module_hook, UserCpuOffloadHook):
        raise TypeError(
            "prev_module_hook must be the UserCpuOffloadHook returned by a previous cpu_offload_with_hook call, "
            f"got {type(prev_module_hook).__name__}"
        )
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def has_offload_index(folder: str | os.PathLike) -> bool:
    """Return whether ``folder`` already holds offloaded weights (an ``index.json``)."""
    return os.path.isdir(folder) and os.path.isfile(os.path.join(folder, INDEX_NAME))


def check_no_meta(state_dict: dict[str, torch.Tensor], where: str) -> None:
    """Raise ``ValueError`` when weights about to be offloaded to ``where`` are on the meta device (no data)."""
    meta = [name for name, t in state_dict.items() if t.device.type == "meta"]
    if meta:
        shown = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
        raise ValueError(
            f"Cannot offload {shown} to {where!r}: these weights are on the meta device (no data) and the "
            "folder holds no offload index. Load a checkpoint first (load_checkpoint_and_dispatch) or "
            "point to a folder that already holds the offloaded weights."
        )


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: torch.device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
    *,
    prefetch: bool | int = True,
    lookahead: int | str | None = None,
    pin_memory: bool | int | str = True,
) -> nn.Module:
    """Return ``model`` with all its weights offloaded to memory-mapped files in ``offload_dir``.

    Weights are written there unless the folder already holds an ``index.json`` (then they are
    read from it as they are). ``execution_device`` defaults to the first parameter's device.

    Args:
        model: The model to offload.
        offload_dir: The folder of the memory-mapped weight files.
        execution_device: Where each module computes (default: the device of the first parameter).
        offload_buffers: Offload the buffers too.
        preload_module_classes: Classes whose whole subtree is loaded at their own forward.
        prefetch: Load weights ahead of time: True (default), False, or how many modules ahead.
        lookahead: CUDA: GPU bytes (or text like "2GiB") for the weights copied ahead.
        pin_memory: CUDA: pin the staging buffers the disk pages go through (True), or not (False).
    """
    if offload_dir is None:
        raise ValueError(
            "disk_offload needs `offload_dir`: the folder where the weights are (or will be) offloaded."
        )
    if not has_offload_index(offload_dir):
        state_dict = model.state_dict()
        check_no_meta(state_dict, os.fspath(offload_dir))
        offload_state_dict(offload_dir, state_dict)
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    streaming = {"lookahead": lookahead, "pin_memory": pin_memory, "owned": True}
    return _offload_whole_model(
        model, execution_device, weights_map, offload_buffers, preload_module_classes, prefetch, streaming
    )
