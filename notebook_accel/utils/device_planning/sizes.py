"""Byte sizes of tensors, modules and layers, computed from shapes and dtypes only (meta models work)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from typing import Union

import torch
from torch import nn

from ..enums import CustomDtype

__all__ = [
    "calculate_maximum_sizes",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "dtype_byte_size",
    "get_max_layer_size",
    "named_module_tensors",
]

# Unit prefixes are case-insensitive ("5kib", "5GIB" as Accelerate reads them); a lowercase "b" after a
# decimal prefix means bits ("5Mb"), after a binary one ("5Gib") still bytes.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTPkmgtp]?[iI]?)([Bb]?)\s*$")
_BINARY = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_NOT_CAST_PREFIXES = ("torch.uint", "torch.int", "torch.bool")


def convert_file_size_to_int(size: Union[int, str]) -> int:
    """Return ``size`` in bytes: an int as is, or a string such as "10GiB" (2**30), "10GB" (10**9), "500MB".

    A lowercase trailing ``b`` means bits ("5Gb" is 5 * 10**9 / 8 bytes), as Accelerate documents.
    """
    if isinstance(size, bool):
        raise TypeError(f"Memory size must be an int or a string like '10GiB', not {size!r}.")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"Memory size must not be negative, got {size}.")
        return size
    if isinstance(size, float) and size >= 0 and size.is_integer():
        return int(size)
    if not isinstance(size, str):
        raise TypeError(
            f"Memory size must be an int or a string like '10GiB', not {type(size).__name__} {size!r}."
        )
    match = _SIZE_RE.match(size)
    unit = match.group(2)[:1].upper() + match.group(2)[1:].lower() if match else ""
    if match is None or (unit not in _BINARY and unit not in _DECIMAL) or (unit and not match.group(3)):
        raise ValueError(
            f"Memory size {size!r} is not in a valid format: use an int (bytes) or a number followed by a unit, "
            "e.g. '10GiB' (2**30 bytes), '10GB' (10**9 bytes), '500MB', '1.5GiB' or '1000'."
        )
    number = float(match.group(1))
    factor = _BINARY[unit] if unit.endswith("i") or unit == "" else _DECIMAL[unit]
    nbytes = number * factor
    if match.group(3) == "b" and not unit.endswith("i"):
        nbytes /= 8
    return int(nbytes)


def _as_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype[len("torch.") :] if dtype.startswith("torch.") else dtype
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"{dtype!r} is not a torch dtype; pass e.g. torch.float16 or 'float16'.")


# Bytes per element of the sub-byte / fp8 weight types (CustomDtype values).
_CUSTOM_DTYPE_BYTES = {"int4": 0.5, "int2": 0.25, "fp8": 1}


def dtype_byte_size(dtype: Union[str, torch.dtype, CustomDtype]) -> float:
    """Return the number of bytes one element of ``dtype`` takes (``torch.bool`` counts 1/8, as in Accelerate).

    ``CustomDtype.INT4`` / ``INT2`` / ``FP8`` (quantized weights) count 1/2, 1/4 and 1 byte.
    """
    if isinstance(dtype, CustomDtype):
        return _CUSTOM_DTYPE_BYTES[dtype.value]
    dtype = _as_dtype(dtype)
    if dtype == torch.bool:
        return 1 / 8
    return dtype.itemsize


def named_module_tensors(
    module: nn.Module,
    include_buffers: bool = True,
    recurse: bool = False,
    remove_non_persistent: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the parameters, then (optionally) the buffers of ``module``.

    ``remove_non_persistent`` leaves out buffers registered with ``persistent=False``.

    Args:
        module: The module to list.
        include_buffers: List the buffers after the parameters (default True).
        recurse: Include the submodules' tensors.
        remove_non_persistent: Leave out buffers registered with ``persistent=False``.
    """
    yield from module.named_parameters(recurse=recurse)
    if not include_buffers:
        return
    if not remove_non_persistent:
        yield from module.named_buffers(recurse=recurse)
        return
    for prefix, sub in module.named_modules() if recurse else [("", module)]:
        skip = sub._non_persistent_buffers_set
        for name, buf in sub._buffers.items():
            if buf is not None and name not in skip:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _tensor_size(
    name: str, tensor: torch.Tensor, dtype_size: float | None, special_sizes: dict[str, float] | None
) -> int:
    """Return the bytes ``tensor`` will take once loaded with the requested dtype rules."""
    if special_sizes is not None and name in special_sizes:
        return int(tensor.numel() * special_sizes[name])
    own = dtype_byte_size(tensor.dtype)
    if dtype_size is None or str(tensor.dtype).startswith(_NOT_CAST_PREFIXES):
        # Integer and bool tensors are never cast when loading, so they keep their own size.
        return int(tensor.numel() * own)
    return int(tensor.numel() * min(dtype_size, own))


def _size_rules(
    dtype: Union[str, torch.dtype, None], special_dtypes: dict | None
) -> tuple[float | None, dict[str, float] | None]:
    dtype_size = None if dtype is None else dtype_byte_size(dtype)
    special = None if not special_dtypes else {k: dtype_byte_size(v) for k, v in special_dtypes.items()}
    return dtype_size, special


def compute_module_sizes(
    model: nn.Module,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Return a dict mapping every module/tensor name prefix (``""`` is the whole model) to its size in bytes.

    Tied parameters are counted once. ``dtype`` caps floating tensors at that element size; integer and bool
    tensors keep theirs; ``special_dtypes`` overrides per tensor name. ``buffers_only`` counts buffers only.

    Args:
        model: The model to measure (a meta model works).
        dtype: Count floating tensors at most at this element size.
        special_dtypes: Tensor name -> dtype, overriding ``dtype``.
        buffers_only: Count buffers only.
    """
    dtype_size, special = _size_rules(dtype, special_dtypes)
    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        size = _tensor_size(name, tensor, dtype_size, special)
        sizes[""] += size
        # Add to every dotted prefix: "a", "a.b", "a.b.c" ...
        end = name.find(".")
        while end != -1:
            sizes[name[:end]] += size
            end = name.find(".", end + 1)
        sizes[name] += size
    if "" not in sizes:
        sizes[""] = 0
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: Union[str, torch.dtype, None] = None,
    special_dtypes: dict[str, Union[str, torch.dtype]] | None = None,
) -> int:
    """Return the total size in bytes of all the buffers of ``model``.

    Args:
        model: The model to measure.
        dtype: Count floating buffers at most at this element size.
        special_dtypes: Tensor name -> dtype, overriding ``dtype``.
    """
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get(
        "", 0
    )


def get_max_layer_size(
    modules: list[tuple[str, Union[nn.Module, torch.Tensor]]],
    module_sizes: dict[str, int],
    no_split_module_classes: list[str],
) -> tuple[int, list[str]]:
    """Return ``(size, names)`` of the largest layer found in ``modules``.

    A layer is a module without children, a module whose class is in ``no_split_module_classes``, or a bare
    tensor; other modules are searched through their children.

    Args:
        modules: ``(name, module or tensor)`` pairs to search.
        module_sizes: Name -> size in bytes, as ``compute_module_sizes`` gives it.
        no_split_module_classes: Module classes counted as one layer.
    """
    no_split = set(no_split_module_classes or [])
    max_size, names = 0, []
    stack = list(reversed(modules))
    while stack:
        name, module = stack.pop()
        children = [] if isinstance(module, torch.Tensor) else list(module.named_children())
        if not children or type(module).__name__ in no_split:
            size = module_sizes.get(name, 0)
            if size > max_size:
                max_size, names = size, [name]
            elif size == max_size and size > 0:
                names.append(name)
        else:
            stack.extend((f"{name}.{n}" if name else n, m) for n, m in reversed(children))
    return max_size, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """Return ``(total_size, (largest_layer_size, largest_layer_names))`` for ``model``.

    The model's ``_no_split_modules`` attribute (as set by Transformers), if any, defines unsplittable layers.
    """
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    top: list[tuple[str, Union[nn.Module, torch.Tensor]]] = [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
    return sizes[""], get_max_layer_size(top, sizes, no_split)
