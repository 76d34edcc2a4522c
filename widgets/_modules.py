"""Model structure helpers shared by the panels: sizes per storage dtype, no-split suggestions."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

__all__: list[str] = []

# Bytes per element of the storage dtypes the panels compare. int8/int4 are what bitsandbytes
# stores per weight (its small per-block scales are left out, as Accelerate's estimator does).
DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "float16": 2.0,
    "bfloat16": 2.0,
    "int8": 1.0,
    "int4": 0.5,
}
# The dtype the arithmetic runs in when weights are stored in each of them.
COMPUTE_DTYPE: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.float16,
    "int4": torch.float16,
}


def dtype_name(dtype: Any) -> str:
    """Return the canonical name (a key of ``DTYPE_BYTES``) of ``dtype``, or raise ValueError listing them."""
    if isinstance(dtype, torch.dtype):
        text = str(dtype).replace("torch.", "")
    elif isinstance(dtype, str):
        text = dtype.replace("torch.", "").strip().lower()
    else:
        raise TypeError(f"dtype must be a string or torch.dtype, got {type(dtype).__name__}: {dtype!r}")
    aliases = {
        "fp32": "float32",
        "float": "float32",
        "fp16": "float16",
        "half": "float16",
        "bf16": "bfloat16",
    }
    text = aliases.get(text, text)
    if text not in DTYPE_BYTES:
        raise ValueError(f"Unsupported dtype {dtype!r}: choose one of {list(DTYPE_BYTES)}")
    return text


def tensor_bytes(tensor: torch.Tensor, dtype: str | None) -> int:
    """Return the bytes ``tensor`` takes once its floating-point values are stored in ``dtype``."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.numel() * tensor.element_size()
    return int(tensor.numel() * DTYPE_BYTES[dtype])


def module_sizes(model: torch.nn.Module, dtype: str | None = None) -> dict[str, int]:
    """Return ``{module name: bytes}`` for every module (``""`` = whole model), weights in ``dtype``.

    Like ``compute_module_sizes`` but for storage dtypes torch has no dtype for (int4); tied
    weights are counted once.
    """
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for name, tensor in _named_tensors(model):
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        nbytes = tensor_bytes(tensor, dtype)
        parts = name.split(".")
        for i in range(len(parts) + 1):  # "", "a", "a.b", ... and the tensor's own name
            prefix = ".".join(parts[:i])
            sizes[prefix] = sizes.get(prefix, 0) + nbytes
    sizes.setdefault("", 0)
    return sizes


def _named_tensors(model: torch.nn.Module):  # noqa: ANN202
    yield from model.named_parameters()
    yield from model.named_buffers()


def suggest_no_split_classes(model: torch.nn.Module) -> list[str]:
    """Return class names worth keeping whole: non-leaf blocks repeated in a ModuleList/Sequential/ModuleDict.

    Transformer blocks hold residual connections, so splitting one across devices would move
    activations back and forth inside the block; repeated containers of such blocks are the
    signature of those classes. Leaf layers (Linear...) are never split anyway and are not listed.
    """
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            for child in module.children():
                has_children = next(child.children(), None) is not None
                if has_children and not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                    counts[type(child).__name__] += 1
    return sorted(name for name, n in counts.items() if n >= 2)


def top_level(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Return the model's own tensors and children: where ``get_max_layer_size`` starts its scan."""
    return [
        *model.named_parameters(recurse=False),
        *model.named_children(),
        *model.named_buffers(recurse=False),
    ]
