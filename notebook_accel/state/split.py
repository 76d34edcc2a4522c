"""Take one process's share of a list, tuple, tensor, array, dataset or dict of those.

Used by ``PartialState.split_between_processes``: shares are contiguous, the first
``len % num_processes`` processes get one element more, and with padding every share is brought to
the longest length by repeating its last element (the input's last element for an empty share).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._lazy import LazyModule

__all__ = ["share_bounds", "take_share"]

# The nested-structure helpers load when a dict is first split, not with the process state.
_structure = LazyModule("notebook_accel.utils._ops_structure")


def share_bounds(length: int, num_processes: int, process_index: int) -> tuple[int, int, int]:
    """Return ``(start, end, padded_length)`` of ``process_index``'s share of ``length`` elements."""
    base, extra = divmod(length, num_processes)
    start = process_index * base + min(process_index, extra)
    end = start + base + (1 if process_index < extra else 0)
    return start, end, base + (1 if extra else 0)


def _cannot_split(inputs: Any) -> TypeError:
    return TypeError(
        f"split_between_processes cannot split a {type(inputs).__name__}: pass a list, tuple, "
        "torch.Tensor, numpy array, datasets.Dataset or a dict of those"
    )


def _length(inputs: Any) -> int:
    try:
        return len(inputs)
    except TypeError:
        raise _cannot_split(inputs) from None


def _slice(inputs: Any, start: int, end: int, padded: int | None) -> Any:
    """Return ``inputs[start:end]``, padded to ``padded`` elements when that is not None."""
    pad = 0 if padded is None else padded - (end - start)
    if isinstance(inputs, torch.Tensor):
        part = inputs[start:end]
        if pad > 0:
            last = part[-1:] if end > start else inputs[-1:]
            part = torch.cat([part, last.expand(pad, *last.shape[1:])])
        return part
    if hasattr(inputs, "select") and hasattr(inputs, "column_names"):  # a datasets.Dataset
        indices = list(range(start, end))
        if pad > 0:
            indices += [(end - 1 if end > start else len(inputs) - 1)] * pad
        return inputs.select(indices)
    if type(inputs).__module__ == "numpy" and hasattr(inputs, "shape"):
        import numpy as np

        part = inputs[start:end]
        if pad > 0:
            last = part[-1:] if end > start else inputs[-1:]
            part = np.concatenate([part, np.repeat(last, pad, axis=0)])
        return part
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise _cannot_split(inputs)
    part = inputs[start:end]
    if pad > 0:
        last = inputs[end - 1] if end > start else inputs[-1]
        part = (
            part + type(part)([last] * pad) if isinstance(part, (list, tuple)) else [*part, *([last] * pad)]
        )
    return part


def take_share(inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False) -> Any:
    """Return the part of ``inputs`` that process ``process_index`` of ``num_processes`` works on."""
    if isinstance(inputs, Mapping):
        lengths = {key: _length(value) for key, value in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes needs every value of the dict to have the same length, got {lengths}"
            )
        length = next(iter(lengths.values()), 0)
    else:
        length = _length(inputs)
    if apply_padding and length == 0:
        raise ValueError(
            "split_between_processes cannot pad empty inputs: there is no last element to repeat"
        )
    start, end, padded = share_bounds(length, num_processes, process_index)
    pad_to = padded if apply_padding else None
    if isinstance(inputs, Mapping):
        return _structure._rebuild_mapping(
            inputs, {key: _slice(value, start, end, pad_to) for key, value in inputs.items()}
        )
    return _slice(inputs, start, end, pad_to)
