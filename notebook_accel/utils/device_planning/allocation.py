"""Allocating modules to devices, the pieces clients call directly: leaves, tied sizes, a module that still fits.

``infer_auto_device_map`` (utils.device_map) plans whole models; these helpers answer the smaller
questions it asks along the way, with Accelerate 1.15's names and signatures.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Union

import torch
from torch import nn

from .sizes import convert_file_size_to_int

__all__ = [
    "check_device_same",
    "check_tied_parameters_in_config",
    "fallback_allocate",
    "get_module_leaves",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
]


def check_device_same(first_device: Any, second_device: Any) -> bool:
    """Return whether two devices are the same, reading a bare accelerator type as its index 0 (``cuda`` == ``cuda:0``)."""
    first, second = torch.device(first_device), torch.device(second_device)
    if first.type != second.type:
        return False
    if first.type == "cpu":
        return True
    return (first.index or 0) == (second.index or 0)


def get_module_leaves(module_sizes: dict[str, int]) -> list[str]:
    """Return the names in ``module_sizes`` (from ``compute_module_sizes``) that have no entry below them."""
    names = [name for name in module_sizes if name]
    parents = {name.rsplit(".", 1)[0] for name in names if "." in name}
    return [name for name in names if name not in parents]


def get_module_size_with_ties(
    tied_params: list[str],
    module_size: int,
    module_sizes: dict[str, int],
    modules_to_treat: list[tuple[str, nn.Module]],
) -> tuple[int, list[str], list[nn.Module]]:
    """Return ``(size, tied module names, tied modules)``: a module's size plus the modules its tied weights live in.

    A weight tied to a parameter of another module in ``modules_to_treat`` forces that module onto the same
    device, so its size counts, minus the shared parameter (stored once). Tied parameters outside
    ``modules_to_treat`` (already placed) add nothing.
    """
    total, names, modules = module_size, [], []
    for param in tied_params:
        owner = next(((n, m) for n, m in modules_to_treat if param.startswith(n + ".")), None)
        if owner is None or owner[0] in names:
            continue
        names.append(owner[0])
        modules.append(owner[1])
        total += module_sizes[owner[0]] - module_sizes.get(param, 0)
    return total, names, modules


def _tied_with(name: str, tied_parameters: list[list[str]]) -> list[str]:
    """Return the parameters tied to a parameter of module ``name`` but living outside it."""
    out = []
    for group in tied_parameters:
        inside = [p for p in group if p.startswith(name + ".")]
        if inside:
            out += [p for p in group if not p.startswith(name + ".")]
    return out


def fallback_allocate(
    modules: list[tuple[str, nn.Module]],
    module_sizes: dict[str, int],
    size_limit: Union[int, str],
    no_split_module_classes: list[str] | None = None,
    tied_parameters: list[list[str]] | None = None,
) -> tuple[str | None, nn.Module | None, list[tuple[str, nn.Module]]]:
    """Return ``(name, module, remaining)``: the first module, breadth first, that fits in ``size_limit``.

    Modules too big are opened (unless their class is in ``no_split_module_classes``) and their children
    tried in turn. ``remaining`` is ``modules`` with the found one taken out (its opened ancestors replaced
    by their other children, in order); ``(None, None, modules)`` when nothing fits.
    """
    limit = convert_file_size_to_int(size_limit)
    no_split = set(no_split_module_classes or ())
    tied = tied_parameters or []
    queue = deque(modules)
    while queue:
        name, module = queue.popleft()
        size, _, _ = get_module_size_with_ties(
            _tied_with(name, tied), module_sizes[name], module_sizes, modules
        )
        if size <= limit:
            return name, module, _without(modules, name)
        if type(module).__name__ not in no_split:
            queue.extend((f"{name}.{child}", sub) for child, sub in module.named_children())
    return None, None, modules


def _without(modules: list[tuple[str, nn.Module]], found: str) -> list[tuple[str, nn.Module]]:
    """Return ``modules`` with ``found`` removed; an ancestor of it is replaced by its other children."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in modules:
        if name == found:
            continue
        if found.startswith(name + "."):
            children = [(f"{name}.{child}", sub) for child, sub in module.named_children()]
            out += _without(children, found)
        else:
            out.append((name, module))
    return out


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Return the names of ``module``'s buffers registered with ``persistent=False`` (not in its state dict).

    ``recurse`` looks in every submodule too; ``fqns`` gives dotted names from ``module``
    (``"block.0.cache"``) instead of the buffers' local names.
    """
    found: set[str] = set()
    for prefix, sub in module.named_modules() if recurse else [("", module)]:
        for name in sub._non_persistent_buffers_set:
            found.add(f"{prefix}.{name}" if fqns and prefix else name)
    return found


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Return whether ``model`` (a transformers model, judged by its config) expects tied weights.

    True when its config asks to tie the word embeddings (and the model has output embeddings), to tie
    encoder and decoder, or when a submodule declares weights it ties (``_tied_weights_keys``).
    """
    config = getattr(model, "config", None)
    if config is not None:
        output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
        if getattr(config, "tie_word_embeddings", False) and output_embeddings is not None:
            return True
        if getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False):
            return True
    return any(bool(getattr(sub, "_tied_weights_keys", None)) for sub in model.modules())
