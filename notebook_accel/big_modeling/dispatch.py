"""Dispatching a model over a device map: ``dispatch_model`` and ``load_checkpoint_and_dispatch``.

The device map is checked once per load (a :class:`~notebook_accel.utils.device_planning.placement.DevicePlacement`
that loading and dispatching share). Modules mapped to a device are placed there by one hook per
block; "cpu" blocks (with a GPU main device) and "disk" blocks are loaded at their forward from a
lazy weights map. Until the hooks are removed, ``model.to(device)`` on a model dispatched with
offloaded weights raises (and warns otherwise), as in Accelerate.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..hooks import attach_align_device_hook_on_blocks
from ..utils.checkpoint_io.checkpoints import load_checkpoint_in_model
from ..utils.device_planning.device_map import DEVICE_MAP_STRATEGIES, check_strategy, resolve_device_map
from ..utils.device_planning.devices import DISK, OFFLOAD_KEYS, Device, device_key, torch_device
from ..utils.device_planning.placement import DevicePlacement, require_offload_folder
from ..utils.device_planning.tied_params import find_tied_parameters
from ..utils.offload import OffloadedWeightsLoader, extract_submodules_state_dict, offload_state_dict
from .offload import check_no_meta, has_offload_index, start_prefetch

__all__ = ["dispatch_model", "load_checkpoint_and_dispatch"]

logger = logging.getLogger(__name__)


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every parameter of a tied group the same object again (after hooks moved them)."""
    for names in groups:
        params = [model.get_parameter(n) for n in names]
        keep = next((p for p in params if p.device.type != "meta"), None)
        if keep is None:
            continue
        for name, param in zip(names, params):
            if param is not keep and param.device == keep.device:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                module._parameters[attr] = keep


_GUARDED_METHODS = ("to", "cuda")


def _guard_moves(model: nn.Module) -> None:
    """Make ``model.to(device)`` / ``model.cuda()`` warn, and refuse while weights are offloaded.

    The wrappers are instance attributes listed in ``model._hf_added_attributes``;
    ``remove_hook_from_module(model)`` removes them.
    """

    def guard(name: str):
        method = getattr(model, name)

        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            moves = True
            if name == "to":
                try:
                    moves = torch._C._nn._parse_to(*args, **kwargs)[0] is not None
                except (TypeError, RuntimeError):
                    moves = True
            if moves:
                offloaded = [n for n, p in model.named_parameters() if p.device.type == "meta"]
                if offloaded:
                    raise RuntimeError(
                        f"Cannot move a dispatched model whose weights are offloaded to the CPU or disk "
                        f"({offloaded[0]!r} and {len(offloaded) - 1} more): remove its hooks first "
                        "(remove_hook_from_submodules(model); remove_hook_from_module(model)), which "
                        "materialises them, or dispatch it again with another device_map."
                    )
                logger.warning(
                    "Moving a model dispatched with hooks: its hooks still move inputs to their devices."
                )
            return method(*args, **kwargs)

        return wrapper

    for name in _GUARDED_METHODS:
        model.__dict__[name] = guard(name)
    model.__dict__["_hf_added_attributes"] = list(_GUARDED_METHODS)


@dataclass(frozen=True)
class _DispatchPlan:
    """What dispatch_model decided from a placement: the main device and, per map entry, where it runs and whether it is offloaded."""

    main_device: Device
    offloaded_keys: tuple[str, ...]
    execution_device: dict[str, Device]
    offload: dict[str, bool]

    @classmethod
    def of(cls, placement: DevicePlacement, main_device: Device | None) -> _DispatchPlan:
        """Return the plan: the main device defaults to the first GPU-like device of the map, else the CPU.

        With a CPU (or MPS) main device only "disk" entries are offloaded; with a GPU, "cpu" ones too.
        """
        if main_device is None:
            on_device = [
                d for name, d in placement.device_map.items() if placement.keys[name] not in OFFLOAD_KEYS
            ]
            main_device = on_device[0] if on_device else "cpu"
        offloaded_keys = (DISK,) if device_key(main_device) in ("cpu", "mps") else OFFLOAD_KEYS
        execution_device = {
            name: main_device if placement.keys[name] in OFFLOAD_KEYS else d
            for name, d in placement.device_map.items()
        }
        execution_device[""] = main_device
        offload = {name: key in offloaded_keys for name, key in placement.keys.items()}
        return cls(main_device, offloaded_keys, execution_device, offload)


def _checked_placement(model: nn.Module, device_map: Any) -> DevicePlacement:
    """Return the placement of ``device_map`` on ``model`` (a dict is checked; a placement for ``model`` is not)."""
    if not isinstance(device_map, (dict, DevicePlacement)):
        raise TypeError(
            f"dispatch_model needs a dict device_map (module name -> device), got {type(device_map).__name__}; "
            f"for {DEVICE_MAP_STRATEGIES} use load_checkpoint_and_dispatch or infer_auto_device_map first."
        )
    if isinstance(device_map, dict) and not device_map:
        raise ValueError(
            "dispatch_model got an empty device_map: map at least '' (the whole model) to a device."
        )
    return DevicePlacement.check(model, device_map)


def _offload_weights_map(
    model: nn.Module,
    placement: DevicePlacement,
    plan: _DispatchPlan,
    state_dict: dict[str, torch.Tensor] | None,
    offload_dir: str | os.PathLike | None,
    offload_index: dict[str, str] | None,
) -> OffloadedWeightsLoader | None:
    """Return the weights map the offloaded blocks read (None when nothing is offloaded).

    With a GPU main device, "cpu" blocks read a CPU copy of their weights; "disk" blocks read
    ``offload_dir`` / ``offload_index``, written from the model first if the folder has no index.
    """
    cpu_modules = placement.modules_on("cpu") if "cpu" in plan.offloaded_keys else []
    if state_dict is None and cpu_modules:
        state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
    disk_modules = placement.disk_modules
    if disk_modules and offload_index is None and not has_offload_index(offload_dir):
        disk_state_dict = extract_submodules_state_dict(model.state_dict(), disk_modules)
        check_no_meta(disk_state_dict, os.fspath(offload_dir))
        offload_state_dict(offload_dir, disk_state_dict)
    save_folder = offload_dir if disk_modules else None
    if state_dict is None and save_folder is None and offload_index is None:
        return None
    return OffloadedWeightsLoader(state_dict=state_dict, save_folder=save_folder, index=offload_index)


def dispatch_model(
    model: nn.Module,
    device_map: dict,
    main_device: torch.device | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: dict[str, str] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    *,
    prefetch: bool | int = True,
    lookahead: int | str | None = None,
    pin_memory: bool | int | str = True,
) -> nn.Module:
    """Return ``model`` dispatched per ``device_map`` (module name -> device, ``"cpu"`` or ``"disk"``).

    Modules mapped to a device are moved there; with a GPU main device, "cpu" modules stay on the
    CPU and are loaded at their forward; "disk" modules are read from ``offload_dir`` /
    ``offload_index`` (written from the model's weights if the folder has no index yet).
    ``{"": "disk"}`` offloads the whole model to disk. Sets ``model.hf_device_map``.

    Args:
        model: The model to place; its modules must match the names of ``device_map``.
        device_map: Module name -> device (an index, a device, "cpu" or "disk").
        main_device: Where offloaded modules compute (default: the first GPU of the map, else the CPU).
        state_dict: The weights of the "cpu" modules (default: taken from the model).
        offload_dir: Folder of the "disk" weights (written there when it has no index yet).
        offload_index: The index of weights already offloaded elsewhere, instead of ``offload_dir``'s.
        offload_buffers: Offload the buffers of offloaded modules too.
        skip_keys: Keys of a module's inputs or outputs not moved between devices.
        preload_module_classes: Classes whose whole subtree is loaded at their own forward, not submodule by
            submodule.
        force_hooks: Install the hooks even when the whole model sits on one device.
        prefetch: Load offloaded weights ahead of time: True (default), False, or how many modules ahead.
        lookahead: GPU main device: bytes (or text like "2GiB") for the offloaded weights copied ahead,
            one device-map entry at a time (default: three entries' worth and at least 256 MiB, within
            half the memory free once the resident part is placed).
        pin_memory: GPU main device: pin the "cpu" entries' weights once (True), not at all (False), or
            up to a size; "disk" entries go through a pinned staging buffer.
    """
    placement = _checked_placement(model, device_map)
    given = offload_dir if offload_dir is not None else offload_index
    require_offload_folder(placement.disk_modules, given, "offload_dir", alternative="offload_index")
    if len(placement.devices) == 1 and not force_hooks and DISK not in placement.devices:
        model.to(torch_device(next(iter(placement.device_map.values()))))
        model.hf_device_map = dict(placement.device_map)
        return model
    plan = _DispatchPlan.of(placement, main_device)
    weights_map = _offload_weights_map(model, placement, plan, state_dict, offload_dir, offload_index)
    groups = find_tied_parameters(model)
    tied_params_map: dict[int, dict] = {model.get_parameter(names[0]).data_ptr(): {} for names in groups}
    attach_align_device_hook_on_blocks(
        model,
        execution_device=plan.execution_device,
        offload=plan.offload,
        offload_buffers=offload_buffers,
        weights_map=weights_map,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_params_map,
    )
    _retie(model, groups)
    offloaded = sorted({str(key) for key in placement.devices if key in plan.offloaded_keys})
    if offloaded:
        logger.info(
            "Some weights are offloaded to %s; they are loaded at each forward.", " and ".join(offloaded)
        )
    blocks = [name for name, offloaded in plan.offload.items() if offloaded]
    start_prefetch(
        model, prefetch, lookahead=lookahead, pin_memory=pin_memory, blocks=blocks, owned=state_dict is None
    )
    _guard_moves(model)
    model.hf_device_map = dict(placement.device_map)
    return model


def _placement_for_load(
    model: nn.Module,
    device_map: Any,
    max_memory: dict[int | str, int | str] | None,
    no_split_module_classes: list[str] | None,
    dtype: str | torch.dtype | None,
    offload_buffers: bool,
    lookahead: int | str | None = None,
) -> DevicePlacement | None:
    """Return the checked placement ``load_checkpoint_and_dispatch`` loads and dispatches with (None: no map)."""
    if device_map is None:
        return None
    if isinstance(device_map, str):
        check_strategy(device_map, alternatives="a dict of module name -> device")
        device_map = resolve_device_map(
            model,
            device_map,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            offload_buffers=offload_buffers,
            streaming_budget=lookahead,
        )
    elif not isinstance(device_map, dict):
        raise TypeError(
            f"device_map must be a dict, one of {list(DEVICE_MAP_STRATEGIES)} or None, got {type(device_map).__name__}"
        )
    return DevicePlacement.check(model, device_map)


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | dict[str, int | str | torch.device] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    *,
    prefetch: bool | int = True,
    lookahead: int | str | None = None,
    pin_memory: bool | int | str = True,
) -> nn.Module:
    """Return ``model`` with ``checkpoint`` loaded into it and, if ``device_map`` is given, dispatched.

    ``device_map`` may be a dict or one of "auto", "balanced", "balanced_low_0", "sequential"
    (computed from ``max_memory`` / ``no_split_module_classes`` / ``dtype``). Weights mapped to
    "disk" need ``offload_folder``; from a safetensors checkpoint they are read in place (no copy).
    The device map is checked once, then loading and dispatching share it.

    Args:
        model: The model to fill, usually built under ``init_empty_weights``.
        checkpoint: A checkpoint file, a sharded checkpoint's index file or a folder holding one.
        device_map: A dict of module name -> device, or a strategy ("auto", "balanced", "balanced_low_0",
            "sequential").
        max_memory: Device -> memory budget for a strategy (default: what is available).
        no_split_module_classes: Module classes a strategy keeps on one device.
        offload_folder: Folder of the weights mapped to "disk".
        offload_buffers: Offload the buffers of offloaded modules too.
        dtype: Cast floating weights to this dtype while loading.
        offload_state_dict: Stage the CPU weights on disk while loading, to spare RAM.
        skip_keys: Keys of a module's inputs or outputs not moved between devices.
        preload_module_classes: Classes whose whole subtree is loaded at their own forward.
        force_hooks: Install the hooks even when the whole model sits on one device.
        strict: Raise when the checkpoint misses keys of the model or holds extra ones.
        full_state_dict: With ``broadcast_from_rank0``, set the weights as one full state dict (False: as the
            model's shards).
        broadcast_from_rank0: Read the checkpoint on rank 0 only and broadcast it.
        prefetch: Load offloaded weights ahead of time: True (default), False, or how many modules ahead.
        lookahead: GPU main device: bytes (or text like "2GiB") for the offloaded weights copied ahead;
            a strategy ``device_map`` then keeps that much of the main GPU free for them
            (``infer_auto_device_map``'s ``streaming_budget``).
        pin_memory: GPU main device: pin the "cpu" entries' weights once (True), not at all (False), or
            up to a size.
    """
    placement = _placement_for_load(
        model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers, lookahead
    )
    disk = placement.disk_modules if placement is not None else []
    require_offload_folder(disk, offload_folder, "offload_folder")
    if offload_state_dict is None and disk:
        offload_state_dict = True
    load_checkpoint_in_model(
        model, checkpoint, device_map=placement, offload_folder=offload_folder, dtype=dtype,
        offload_state_dict=bool(offload_state_dict), offload_buffers=offload_buffers, strict=strict,
        full_state_dict=full_state_dict, broadcast_from_rank0=broadcast_from_rank0,
    )  # fmt: skip
    if placement is None:
        return model
    return dispatch_model(
        model, device_map=placement, offload_dir=offload_folder, offload_buffers=offload_buffers,
        skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks,
        prefetch=prefetch, lookahead=lookahead, pin_memory=pin_memory,
    )  # fmt: skip
