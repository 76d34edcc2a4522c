"""The structure side of the collectives in ``operations``: a nested structure flattened into its tensors
(grouped by device and dtype, one flat buffer per group) and refilled, and the outline of a structure that
debug mode compares between ranks. Reads no process state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._ops_structure import recursively_apply

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# flattening a structure into its tensors and back


def _leaves(data: Any, op: str) -> list[torch.Tensor]:
    """Return the tensors of ``data`` in traversal order (TypeError naming ``op`` for other leaves)."""
    out: list[torch.Tensor] = []

    def visit(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif isinstance(node, (list, tuple)):
            for item in node:
                visit(item)
        elif isinstance(node, Mapping):
            for item in node.values():
                visit(item)
        else:
            raise TypeError(
                f"Unsupported type {type(node).__name__} passed to `{op}`: only nested lists/tuples/dicts of "
                "torch.Tensor can be passed (use gather_object / broadcast_object_list for other objects)"
            )

    visit(data)
    return out


def _refill(data: Any, tensors: list[torch.Tensor]) -> Any:
    """Return ``data`` with its tensors replaced, in traversal order, by ``tensors``."""
    if isinstance(data, torch.Tensor):
        return tensors[0]
    it = iter(tensors)
    return recursively_apply(lambda _: next(it), data)


def _groups(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Return the indices of ``tensors`` grouped by (device, dtype): each group shares one flat buffer."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """Return a view of ``tensor`` that backends can transfer (bool travels as uint8)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


# ---------------------------------------------------------------------------------------------
# debug mode: an outline of each rank's structure, compared before a collective


def _signature(data: Any) -> Any:
    """Return a picklable, comparable outline of ``data``: plain lists/dicts, leaves (shape, dtype)."""
    if isinstance(data, torch.Tensor):
        return (tuple(data.shape), str(data.dtype).replace("torch.", ""))
    if isinstance(data, (list, tuple)):
        return [_signature(x) for x in data]
    if isinstance(data, Mapping):
        return {k: _signature(v) for k, v in data.items()}
    return type(data).__name__


def _outline(signature: Any) -> Any:
    """Return ``signature`` with the sizes dropped (only the structure, ndims and dtypes remain)."""
    if isinstance(signature, tuple):
        return (len(signature[0]), signature[1])
    if isinstance(signature, list):
        return [_outline(x) for x in signature]
    if isinstance(signature, dict):
        return {k: _outline(v) for k, v in signature.items()}
    return signature


def _render(signature: Any) -> str:
    if isinstance(signature, tuple):
        return f"{signature[1]}{list(signature[0])}"
    if isinstance(signature, list):
        return "[" + ", ".join(_render(x) for x in signature) + "]"
    if isinstance(signature, dict):
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in signature.items()) + "}"
    return str(signature)
