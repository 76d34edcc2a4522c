"""Questions about a hooked model's offloaded weights: is this module offloaded, bring its weights in
for a moment, read the whole state dict back, where does each module's weights live.

They read the :class:`~notebook_accel.hooks.align.AlignDevicesHook` a module carries, so they live
with the hooks; ``notebook_accel.utils`` lists ``has_offloaded_params``, ``align_module_device``
and ``get_state_dict_offloaded_model`` in its lazy table (Accelerate documents them there) and
``notebook_accel.telemetry`` re-exports :func:`weight_placement`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..utils.device_planning.devices import Device, device_label
from ..utils.device_planning.tensors import set_module_tensor_to_device
from .align import AlignDevicesHook
from .base import SequentialHook

__all__ = [
    "align_module_device",
    "find_align_hook",
    "get_state_dict_from_offload",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "weight_placement",
]


def find_align_hook(module: nn.Module) -> AlignDevicesHook | None:
    """Return the AlignDevicesHook attached to ``module`` (in a SequentialHook: the offloading one first)."""
    hook = module.__dict__.get("_hf_hook")
    if isinstance(hook, AlignDevicesHook):
        return hook
    if isinstance(hook, SequentialHook):
        found = [sub for sub in hook.hooks if isinstance(sub, AlignDevicesHook)]
        offloading = [sub for sub in found if sub.offload]
        return (offloading or found or [None])[0]
    return None


def has_offloaded_params(module: nn.Module) -> bool:
    """Return True when ``module`` has an AlignDevicesHook with offloading enabled."""
    hook = find_align_hook(module)
    return hook is not None and bool(hook.offload)


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: Device | None = None) -> Iterator[None]:
    """Yield with ``module``'s own parameters on its execution device (or ``execution_device``).

    For an offloaded module the weights are loaded for the duration of the block and released
    after; otherwise, with ``execution_device`` given, the parameters are moved there and back.
    """
    hook = find_align_hook(module)
    if hook is not None and hook.offload:
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook._load(module)
            yield
        finally:
            hook._offload(module)
            hook.execution_device = original
    elif execution_device is not None:
        # Keep the original parameters: putting them back is exact (and works from the meta device).
        originals = dict(module._parameters)
        try:
            for name, param in originals.items():
                if param is not None:
                    set_module_tensor_to_device(module, name, execution_device, value=param.data)
            yield
        finally:
            module._parameters.update(originals)
    else:
        yield


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    """Return the module's own parameters and persistent buffers, by local name."""
    buffers = [(k, v) for k, v in module._buffers.items() if k not in module._non_persistent_buffers_set]
    return list(module._parameters.items()) + buffers


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the full state dict of ``model`` on the CPU, reading offloaded (hooked) weights back from their maps."""
    state: dict[str, torch.Tensor] = {}
    for name, sub in model.named_modules():
        own = _own_tensors(sub)
        if not any(t is not None for _, t in own):
            continue
        prefix = f"{name}." if name else ""
        if has_offloaded_params(sub):
            with align_module_device(sub, torch.device("cpu")):
                for key, tensor in sub.state_dict(keep_vars=False).items():
                    if "." not in key:
                        state[prefix + key] = tensor.detach().clone()
            continue
        for key, tensor in own:
            if tensor is None:
                continue
            if tensor.device.type == "meta":
                raise ValueError(f"{prefix + key} is on the meta device and has no offloaded copy to read.")
            state[prefix + key] = tensor.detach().to("cpu")
    return state


def get_state_dict_from_offload(
    module: nn.Module, module_name: str, state_dict: dict[str, Any], device_to_put_offload: Any = "cpu"
) -> dict[str, Any]:
    """Return ``state_dict`` with ``module``'s weights added under ``module_name.<key>``, read onto a device.

    An offloaded (hooked) module's weights are loaded from their offload map for the read; every
    value lands on ``device_to_put_offload`` (the CPU by default). ``state_dict`` is updated in place.
    """
    prefix = f"{module_name}." if module_name else ""
    # Each submodule's hook holds that submodule's weights: align them one module at a time.
    for sub_name, sub in module.named_modules():
        sub_prefix = prefix + (f"{sub_name}." if sub_name else "")
        aligned = (
            align_module_device(sub, device_to_put_offload)
            if has_offloaded_params(sub)
            else contextlib.nullcontext()
        )
        with aligned:
            for key, tensor in _own_tensors(sub):
                if tensor is None:
                    continue
                if tensor.device.type == "meta":
                    raise ValueError(
                        f"{sub_prefix + key} is on the meta device and has no offloaded copy: load its weights "
                        "(load_checkpoint_in_model) or dispatch the model with an offload first."
                    )
                state_dict[sub_prefix + key] = tensor.detach().to(device_to_put_offload)
    return state_dict


def _placement_of(module: nn.Module, owner: AlignDevicesHook | None) -> dict | None:
    """Return ``{"execution_device", "storage", "nbytes"}`` for ``module``'s own tensors (None if it has none)."""
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    if not tensors:
        return None
    by_storage: dict[str, int] = {}
    for tname, tensor in tensors:
        if owner is not None:
            storage, size = owner._storage_of(module, tname, tensor)
        else:
            storage, size = device_label(tensor.device), tensor.numel() * tensor.element_size()
        by_storage[storage] = by_storage.get(storage, 0) + size
    exec_device = None
    if owner is not None and owner._device is not None:
        exec_device = device_label(owner._device)
    # A module's storage is where most of its bytes are (e.g. weights on disk, small buffers on the CPU).
    storage = max(by_storage, key=by_storage.__getitem__)
    return {"execution_device": exec_device, "storage": storage, "nbytes": sum(by_storage.values())}


def weight_placement(model: Any) -> dict[str, dict]:
    """Return, for every module with own parameters/buffers, where it runs and where its weights live.

    Each value is ``{"execution_device": str | None, "storage": str, "nbytes": int}``. ``storage``
    is ``"disk"`` for weights read from offload files or a checkpoint on disk, the device of the
    offload copy (``"cpu"``...) for other offloaded weights, otherwise the device of the tensors
    themselves (``"meta"`` for an empty model). ``execution_device`` is the hook's execution
    device, or None for a module without a device hook.
    """
    result: dict[str, dict] = {}
    # Stack of (prefix, hook) for ancestors whose hook manages their submodules' weights.
    inherited: list[tuple[str, AlignDevicesHook]] = []
    for name, module in model.named_modules():
        while inherited and not (inherited[-1][0] == "" or name.startswith(inherited[-1][0] + ".")):
            inherited.pop()
        hook = find_align_hook(module)
        owner = hook if hook is not None else (inherited[-1][1] if inherited else None)
        if hook is not None and hook.place_submodules:
            inherited.append((name, hook))
        placement = _placement_of(module, owner)
        if placement is not None:
            result[name] = placement
    return result
