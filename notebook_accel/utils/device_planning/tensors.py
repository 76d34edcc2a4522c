"""Putting one parameter or buffer of a module on a device, and storage identity of tensors.

(Reading a hooked model's offloaded state dict back is ``notebook_accel.hooks.offloaded``'s job.)"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import nn

from .._errors import add_note
from ..memory import clear_device_cache
from .devices import torch_device
from .sizes import _as_dtype

__all__ = ["id_tensor_storage", "set_module_tensor_to_device"]

_NOT_CAST_PREFIXES = ("torch.uint", "torch.int", "torch.bool")


def _resolve(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    owner = module
    *path, leaf = tensor_name.split(".")
    for part in path:
        child = getattr(owner, part, None)
        if not isinstance(child, nn.Module):
            raise ValueError(
                f"{type(owner).__name__} has no submodule {part!r} (while resolving {tensor_name!r})."
            )
        owner = child
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ValueError(
            f"{type(owner).__name__} does not have a parameter or a buffer named {leaf!r} ({tensor_name!r})."
        )
    return owner, leaf


def shape_mismatch(tensor_name: str, module: nn.Module, expected: torch.Size, got: torch.Size) -> ValueError:
    """Return the ValueError for a value of shape ``got`` set into ``tensor_name`` (shape ``expected``) of ``module``."""
    leaf = tensor_name.rpartition(".")[2]
    # Accelerate 1.15's message exactly (code matches on it; it names only the leaf); the full tensor
    # name and the way out go in a note, which a traceback shows under it.
    error = ValueError(
        f'Trying to set a tensor of shape {got} in "{leaf}" (which has shape {expected}), this looks incorrect.'
    )
    add_note(
        error,
        f"{tensor_name!r} of {type(module).__name__} has shape {tuple(expected)}, the value {tuple(got)}; the "
        "checkpoint does not match the model."
    )
    return error


def _same_place(tensor: torch.Tensor, device: torch.device) -> bool:
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device: Union[int, str, torch.device],
    value: torch.Tensor | None = None,
    dtype: Union[str, torch.dtype, None] = None,
    fp16_statistics: torch.HalfTensor | None = None,
    tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Set ``tensor_name`` of ``module`` on ``device``, optionally to ``value``; its class and grad flag stay.

    Args:
        module, tensor_name: The module and the dotted name (``"layers.0.weight"``) of its parameter or buffer.
        device: Where it goes.
        value: A new value (default: the tensor's own, moved); a CPU one of the right dtype is used as is.
        dtype: Cast floating values to it (integer and bool ones never); default: the replaced tensor's dtype.
        fp16_statistics: The scales of an 8-bit bitsandbytes weight.
        tied_params_map: Data pointer -> device -> tensor: a tied tensor already on ``device`` is reused.
        non_blocking: Copy asynchronously where the devices allow it.
        clear_cache: Empty the accelerator's cache after a move to or from it (default True).
    """
    owner, leaf = _resolve(module, tensor_name)
    target = torch_device(device)
    is_buffer = leaf in owner._buffers
    old = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]

    source = value if value is not None else old
    if tied_params_map is not None and source.device.type != "meta":
        ptr = source.data_ptr()
        if ptr in tied_params_map and target in tied_params_map[ptr]:
            reused = tied_params_map[ptr][target]
            if is_buffer:
                owner._buffers[leaf] = reused
            else:
                owner._parameters[leaf] = reused
            return

    if old.device.type == "meta" and target.type != "meta" and value is None:
        raise ValueError(f"{tensor_name} is on the meta device: pass a `value` to put it on {target}.")

    if value is not None:
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if old.shape != value.shape:
            raise shape_mismatch(tensor_name, module, old.shape, value.shape)
        if dtype is None:
            # The tensor's own dtype wins, whatever the value's kind (an int64 checkpoint tensor for a float
            # weight becomes float), as in load_state_dict; quantised parameter classes convert for themselves.
            if value.dtype != old.dtype and type(old) in (nn.Parameter, torch.Tensor):
                value = value.to(old.dtype)
        elif not str(value.dtype).startswith(_NOT_CAST_PREFIXES):
            value = value.to(_as_dtype(dtype))
    elif dtype is not None and old.is_floating_point():
        old = old.to(_as_dtype(dtype))

    with torch.no_grad():
        if value is None:
            new_value = old if _same_place(old, target) else old.to(target, non_blocking=non_blocking)
        else:
            new_value = value if _same_place(value, target) else value.to(target, non_blocking=non_blocking)

    if is_buffer:
        owner._buffers[leaf] = new_value
    else:
        param = owner._parameters[leaf]
        if new_value is not param:
            owner._parameters[leaf] = _rewrap(param, new_value)
    if fp16_statistics is not None:
        owner._parameters[leaf].SCB = fp16_statistics.to(target)

    if clear_cache and _ACCELERATOR_TYPES & {old.device.type, target.type}:
        clear_device_cache()

    if tied_params_map is not None and source.device.type != "meta":
        ptr = source.data_ptr()
        if ptr in tied_params_map and target not in tied_params_map[ptr]:
            tied_params_map[ptr][target] = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]


# Devices with a caching allocator worth emptying after a move (CPU and meta have none).
_ACCELERATOR_TYPES = frozenset({"cuda", "xpu", "npu", "mlu", "musa", "sdaa", "hpu", "mps", "neuron"})


def _rewrap(old: Any, data: torch.Tensor) -> torch.Tensor:
    """Return ``data`` wrapped like ``old`` (same Parameter subclass, requires_grad and extra attributes)."""
    if not isinstance(old, nn.Parameter):
        return data
    if isinstance(data, nn.Parameter):
        data = data.detach()  # a new Parameter object over the same memory, never the caller's own
    cls = type(old)
    requires_grad = old.requires_grad and (data.is_floating_point() or data.is_complex())
    try:
        new = cls(data, requires_grad=requires_grad)
    except TypeError:
        new = nn.Parameter(data, requires_grad=requires_grad)
    # Subclasses (quantisation libraries) keep state in attributes; carry it over.
    for key, val in getattr(old, "__dict__", {}).items():
        if key not in new.__dict__:
            try:
                setattr(new, key, val)
            except AttributeError:
                pass
    return new


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """Return ``(device, storage pointer, storage bytes)``: equal for tensors sharing memory.

    Meta and storage-less tensors report pointer 0 and their own byte size.
    """
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.device, 0, tensor.numel() * tensor.element_size()
