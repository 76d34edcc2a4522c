"""Walk nested lists / tuples / namedtuples / dicts of tensors, keeping every container's type.

The process-independent half of ``notebook_accel.utils.operations``: mapping a function over the
tensors of a structure, moving it to a device, slicing, concatenating, measuring, converting.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "ConvertOutputsToFp32",
    "TensorInformation",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "find_batch_size",
    "get_data_structure",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "find_device",
    "get_shape",
    "is_torch_tensor",
    "is_torch_xpu_tensor",
    "listify",
    "pad_input_tensors",
    "recursively_apply",
    "send_to_device",
    "slice_tensors",
]


@dataclasses.dataclass(frozen=True)
class TensorInformation:
    """The shape and dtype of a tensor, enough to allocate a matching empty one."""

    shape: torch.Size
    dtype: torch.dtype


def is_torch_tensor(tensor: object) -> bool:
    """Return whether ``tensor`` is a ``torch.Tensor``."""
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info: object) -> bool:
    """Return whether ``tensor_info`` is a :class:`TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def is_namedtuple(data: object) -> bool:
    """Return whether ``data`` is an instance of a ``collections.namedtuple`` / ``typing.NamedTuple`` class."""
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


def honor_type(obj: Any, generator: Iterable) -> Any:
    """Return the items of ``generator`` in a container of the same type as ``obj`` (namedtuples included)."""
    # Materialise first, so that an error raised while producing the items is not mistaken below
    # for a constructor that rejects an iterable.
    items = list(generator)
    if is_namedtuple(obj):
        return type(obj)(*items)
    try:
        return type(obj)(items)
    except TypeError:
        if not isinstance(obj, (list, tuple)):
            raise  # not a container: its constructor's own TypeError, as Accelerate 1.15 gives
        # A list/tuple subclass whose constructor takes the items as separate arguments.
        return type(obj)(*items)


def _rebuild_mapping(original: Mapping, items: dict) -> Any:
    """Return ``items`` in a mapping of ``original``'s type (dict, OrderedDict, defaultdict, BatchEncoding...)."""
    if type(original) is dict:
        return items
    try:
        return type(original)(items)
    except TypeError:
        pass
    try:
        # Mappings whose constructor is not dict-like (defaultdict): copy, then overwrite the values.
        out = copy.copy(original)
        for key, value in items.items():
            out[key] = value
        return out
    except TypeError:
        return items


def _is_container(data: object) -> bool:
    return isinstance(data, (list, tuple, Mapping))


def _map_children(data: list | tuple | Mapping, visit: Callable[[Any], Any], skip: Any = ()) -> Any:
    """Return container ``data`` rebuilt with its own type, ``visit`` applied to each child.

    The one place that knows how containers are taken apart and rebuilt; mapping values under the
    keys in ``skip`` are kept as they are.
    """
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {k: v if k in skip else visit(v) for k, v in data.items()})
    return honor_type(data, (visit(item) for item in data))


def recursively_apply(
    func: Callable,
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Return ``data`` with ``func(x, *args, **kwargs)`` applied to every leaf ``x`` passing ``test_type``.

    Lists, tuples, namedtuples and mappings are rebuilt with their own types; other leaves are kept
    as they are, or rejected with TypeError when ``error_on_other_type``.

    Args:
        func: Applied to every leaf that passes ``test_type``.
        data: A leaf, or nested lists/tuples/namedtuples/mappings of leaves.
        *args: Extra positional arguments of ``func``.
        test_type: Which leaves ``func`` applies to (default: tensors).
        error_on_other_type: Raise TypeError on a leaf that fails ``test_type`` instead of keeping it.
        **kwargs: Extra keyword arguments of ``func``.
    """

    def visit(node: Any) -> Any:
        if _is_container(node):
            return _map_children(node, visit)
        if test_type(node):
            return func(node, *args, **kwargs)
        if error_on_other_type:
            # The text starts as Accelerate 1.15's does: callers match on it.
            raise TypeError(
                f"Unsupported types ({type(node)}) passed to `{getattr(func, '__name__', func)}`. Only "
                "nested list/tuple/dicts of objects that are valid for "
                f"`{getattr(test_type, '__name__', test_type)}` should be passed."
            )
        return node

    return visit(data)


def send_to_device(
    tensor: Any,
    device: int | str | torch.device,
    non_blocking: bool = False,
    skip_keys: str | list[str] | None = None,
) -> Any:
    """Return ``tensor`` (nested lists/tuples/dicts of tensors) with every tensor moved to ``device``.

    Objects with a ``.to`` method (e.g. a tokenizer's BatchEncoding) are moved with it; values under
    ``skip_keys`` (a key or a list of keys of a mapping) stay where they are. Tensors already on
    ``device`` are returned as they are (no copy).

    Args:
        tensor: A tensor, an object with ``.to`` or nested lists/tuples/dicts of them.
        device: Where to move them.
        non_blocking: Copy asynchronously where the devices allow it.
        skip_keys: Mapping keys (one or a list) whose values stay where they are.
    """
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())

    def visit(node: Any) -> Any:
        if _is_container(node):
            return _map_children(node, visit, skip)
        if isinstance(node, torch.Tensor) or callable(getattr(node, "to", None)):
            try:
                return node.to(device, non_blocking=non_blocking)
            except TypeError:  # a .to() that does not take non_blocking
                return node.to(device)
        return node

    return visit(tensor)


def listify(data: Any) -> Any:
    """Return ``data`` with every tensor turned into (nested) Python lists of numbers."""

    def _to_list(tensor: torch.Tensor) -> Any:
        if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            tensor = tensor.float()  # numpy-less conversions still need a standard dtype
        return tensor.detach().cpu().tolist()

    return recursively_apply(_to_list, data)


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float()


def _is_half(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Return ``tensor`` (nested lists/tuples/dicts) with its fp16 and bf16 tensors converted to fp32."""
    if type(tensor) is torch.Tensor:  # a prepared model's usual output, on every forward: no walk
        return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
    return recursively_apply(_fp32, tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """A forward function whose outputs are converted to fp32 (picklable when the wrapped one is)."""

    def __init__(self, model_forward: Callable) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))


def convert_outputs_to_fp32(model_forward: Callable) -> Callable:
    """Return ``model_forward`` wrapped so that its fp16/bf16 outputs come back as fp32."""
    if not callable(model_forward):
        raise TypeError(
            f"convert_outputs_to_fp32 expects a callable forward, got {type(model_forward).__name__}"
        )
    return ConvertOutputsToFp32(model_forward)


def slice_tensors(
    data: Any, tensor_slice: Any, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Return ``data`` with every tensor indexed by ``tensor_slice`` (e.g. ``slice(0, 4)``).

    ``process_index`` and ``num_processes`` are accepted for compatibility and not used.

    Args:
        data: A tensor or nested lists/tuples/dicts of tensors.
        tensor_slice: The index applied to each tensor (a slice, an int, ...).
        process_index: Not used; kept for Accelerate's signature.
        num_processes: Not used; kept for Accelerate's signature.
    """

    def _slice(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[tensor_slice]

    return recursively_apply(_slice, data)


def concatenate(data: list | tuple, dim: int = 0) -> Any:
    """Return one structure whose tensors are those of the structures in ``data`` concatenated along ``dim``."""
    if isinstance(data, str):  # 1.15 reads a string as the sequence of its characters: a str leaf
        raise TypeError(f"Can only concatenate tensors but got {str}")
    if not isinstance(data, (list, tuple)):
        raise TypeError(f"concatenate takes a list or tuple of structures, got {type(data).__name__}")
    if not data:
        raise ValueError("concatenate got an empty list: give it at least one structure")
    template = data[0]  # every structure is assumed to have this one's shape
    if isinstance(template, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if isinstance(template, Mapping):
        merged = {key: concatenate([part[key] for part in data], dim=dim) for key in template}
        return _rebuild_mapping(template, merged)
    if not isinstance(template, (list, tuple)):
        if len(data) == 1:  # nothing to join: one leaf comes back as it is, as in 1.15
            return template
        raise TypeError(f"Can only concatenate tensors but got {type(template)}")  # 1.15's text
    columns = [list(column) for column in zip(*data)]
    sizes = sorted({len(part) for part in data})
    if len(sizes) > 1:
        if columns:  # leaves that are not tensors are the TypeError 1.15 gives, whatever the lengths
            concatenate(columns[0], dim=dim)
        raise ValueError(
            f"concatenate: the sequences to join have different lengths {sizes}; give them one length"
        )
    return honor_type(template, (concatenate(column, dim=dim) for column in columns))


def find_batch_size(data: Any) -> int:
    """Return the size of the first dimension of the first tensor found in ``data``."""
    node = data
    while not isinstance(node, torch.Tensor):  # descend through the first item of each container
        if not isinstance(node, (list, tuple, Mapping)):
            raise TypeError(f"find_batch_size looks for tensors, got {type(node).__name__}")
        if not node:
            raise ValueError(f"find_batch_size found an empty {type(node).__name__}: it holds no tensor")
        node = next(iter(node.values())) if isinstance(node, Mapping) else node[0]
    if node.dim() == 0:
        raise ValueError("find_batch_size found a 0-dim tensor first: a scalar has no batch dimension")
    return node.shape[0]


def ignorant_find_batch_size(data: Any) -> int | None:
    """Return ``find_batch_size(data)``, or None where it cannot be found."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def _info(tensor: torch.Tensor) -> TensorInformation:
    return TensorInformation(shape=tensor.shape, dtype=tensor.dtype)


def get_data_structure(data: Any) -> Any:
    """Return ``data`` with every tensor replaced by its :class:`TensorInformation`."""
    return recursively_apply(_info, data)


def _empty(info: TensorInformation) -> torch.Tensor:
    return torch.empty(info.shape, dtype=info.dtype)


def initialize_tensors(data_structure: Any) -> Any:
    """Return ``data_structure`` with every :class:`TensorInformation` replaced by an empty CPU tensor."""
    return recursively_apply(_empty, data_structure, test_type=is_tensor_information)


def is_torch_xpu_tensor(tensor: object) -> bool:
    """Return whether ``tensor`` is a tensor on an Intel XPU."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xpu"


def find_device(data: Any) -> torch.device | None:
    """Return the device of the first tensor in ``data`` (nested lists/tuples/dicts), or None without one."""
    if isinstance(data, torch.Tensor):
        return data.device
    if _is_container(data):
        for item in data.values() if isinstance(data, Mapping) else data:
            device = find_device(item)
            if device is not None:
                return device
    return None


def get_shape(data: Any) -> Any:
    """Return ``data`` with every tensor replaced by its shape as a list of ints."""
    return recursively_apply(lambda tensor: list(tensor.shape), data)


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Return ``tensor`` (nested lists/tuples/dicts) zero-padded along ``dim`` so ``num_processes`` can split it.

    The size along ``dim`` grows from ``batch_size`` to the next multiple of ``num_processes`` (at least
    ``num_processes``): ``[3, 4, 4]`` for 4 processes becomes ``[4, 4, 4]``.

    Args:
        tensor: A tensor or nested lists/tuples/dicts of tensors.
        batch_size: The current size along ``dim``.
        num_processes: How many processes will split the result.
        dim: The dimension to pad (default 0).
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"pad_input_tensors: num_processes must be a positive int, got {num_processes!r}")
    target = max(num_processes, -(-batch_size // num_processes) * num_processes)

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0 or t.shape[dim] >= target:
            return t
        shape = list(t.shape)
        shape[dim] = target - t.shape[dim]
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    return recursively_apply(_pad, tensor)
