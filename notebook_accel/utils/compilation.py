"""Regional compilation: ``torch.compile`` each repeated block once (the compiler's cache serves the rest).

A transformer's layers are one class repeated in a ``ModuleList``; compiling them one by one reuses
the first compilation for the others, so the cold start costs one block, not the whole model.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "compile_regions",
    "compile_regions_deepspeed",
    "compile_regions_fsdp2",
    "has_compiled_regions",
    "has_repeated_blocks",
    "is_compiled_module",
    "is_repeated_blocks",
]


def is_compiled_module(module: object) -> bool:
    """Return whether ``module`` is the wrapper ``torch.compile`` returns (an ``OptimizedModule``)."""
    # Only when dynamo is loaded: a module cannot have been compiled otherwise, and importing it is slow.
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


def has_compiled_regions(module: nn.Module) -> bool:
    """Return whether some submodule of ``module`` was compiled with ``torch.compile``."""
    return any(is_compiled_module(sub) for sub in module.modules() if sub is not module)


def is_repeated_blocks(module: nn.Module) -> bool:
    """Return whether ``module`` is a non-empty ``ModuleList`` whose children all have one class."""
    return (
        isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(child) for child in module}) == 1
    )


def has_repeated_blocks(module: nn.Module) -> bool:
    """Return whether ``module`` holds repeated blocks at any depth (itself included)."""
    return any(is_repeated_blocks(sub) for sub in module.modules())


def _compiled_copy(module: nn.Module, compile_kwargs: dict[str, Any]) -> nn.Module:
    if is_repeated_blocks(module):
        return nn.ModuleList([torch.compile(block, **compile_kwargs) for block in module])
    if has_repeated_blocks(module):
        # A shallow copy: same parameters, its own child table, so the caller's model is untouched.
        new = copy.copy(module)
        new._modules = {
            name: _compiled_copy(child, compile_kwargs) for name, child in module._modules.items()
        }
        return new
    return torch.compile(module, **compile_kwargs)


def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Return a new model sharing ``module``'s weights whose repeated blocks are compiled one by one.

    The blocks of each ``ModuleList`` of one class become ``torch.compile`` d modules; every other part
    that holds no repeated blocks is compiled whole; containers of repeated blocks stay eager. Without
    repeated blocks the whole model is compiled. ``compile_kwargs`` go to ``torch.compile``.
    """
    if not has_repeated_blocks(module):
        return torch.compile(module, **compile_kwargs)
    new = _compiled_copy(module, compile_kwargs)
    new.__dict__["_orig_mod"] = module  # unwrap_model finds the original through it
    return new


def _regions(module: nn.Module) -> Iterator[nn.Module]:
    """Yield the parts regional compilation compiles, in module order.

    Those are the blocks of every repeated ``ModuleList`` and each largest part holding no repeated
    blocks (the whole of ``module`` when it holds none). Containers of repeated blocks stay eager.
    """
    if is_repeated_blocks(module):
        yield from module
        return
    if not has_repeated_blocks(module):
        yield module
        return
    for child in module.children():
        yield from _regions(child)


def _compile_in_place(module: nn.Module, compile_kwargs: dict[str, Any]) -> None:
    for region in _regions(module):
        region.compile(**compile_kwargs)


def compile_regions_deepspeed(module: nn.Module, **compile_kwargs: Any) -> None:
    """Compile ``module``'s repeated blocks in place (``nn.Module.compile``), as a DeepSpeed engine needs.

    DeepSpeed keeps hooks and offloaded parameters on the module objects it wraps, so they are
    compiled where they are instead of being replaced by new wrapper objects.
    """
    _compile_in_place(module, compile_kwargs)


def compile_regions_fsdp2(module: nn.Module, **compile_kwargs: Any) -> None:
    """Compile ``module``'s repeated blocks in place, keeping the FSDP2-sharded module objects."""
    _compile_in_place(module, compile_kwargs)
