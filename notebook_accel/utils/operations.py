"""Data operations that work across processes on nested lists / tuples / dicts of tensors.

``gather``, ``reduce``, ``broadcast`` and ``pad_across_processes`` take any nested structure of
tensors and keep its container types. With one process they return their input at once (no
collective, no copy). With several, tensors of a structure that share a device and dtype are packed
into one flat buffer, so a dict of 100 small tensors costs one collective, not 100.

Debug mode (``ACCELERATE_DEBUG_MODE=1``): before a collective every rank's shapes are compared (one
``all_gather_object``) and a mismatch raises :class:`DistributedOperationException` listing each
rank's shapes, instead of hanging or returning garbage.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..state import AcceleratorState, PartialState
from . import _ops_structure
from ._ops_packing import _groups, _leaves, _outline, _refill, _render, _signature, _wire
from ._ops_structure import *  # noqa: F403 (Accelerate serves the structure helpers at this path too)
from .constants import TORCH_DISTRIBUTED_OPERATION_TYPES
from .enums import DistributedType
from .environment import parse_flag_from_env
from .imports import is_npu_available, is_torch_distributed_available, is_torch_xla_available
from .versions import is_torch_version

__all__ = [
    "TENSOR_INT_TO_DTYPE",
    "TENSOR_TYPE_TO_INT",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "CannotPadNestedTensorWarning",
    "GatheredParameters",
    "chained_operation",
    "copy_tensor_to_devices",
    "gather_tensor_shape",
    "verify_operation",
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "reduce",
]
# The structure helpers (state-free, in _ops_structure) are served at this path too, as in Accelerate.
__all__ += _ops_structure.__all__
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "DistributedType",
    "is_npu_available",
    "is_torch_distributed_available",
    "is_torch_version",
    "is_torch_xla_available",
]
# Accelerate serves the state classes here too; this module reads the state (rank, world size).
__all__ += ["AcceleratorState", "PartialState"]

# Each reduction and the collective it runs ("mean" sums, then divides). "max" is Accelerate 1.15's;
# "min" is a real minimum here (1.15 sums for it, as for any other string it does not know).
_REDUCTIONS = {"mean": "sum", "sum": "sum", "none": None, "max": "max", "min": "min"}
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch >= 2.13 renamed all_gather_into_tensor; both gather equal-sized tensors into one buffer.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# Dtypes as small ints, to send a dtype through an integer tensor collective.
TENSOR_TYPE_TO_INT = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
TENSOR_INT_TO_DTYPE = {number: dtype for dtype, number in TENSOR_TYPE_TO_INT.items()}


class DistributedOperationException(RuntimeError):
    """A collective was called with data that does not match across processes (shapes, dtypes, structure)."""


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested (jagged) tensor: it has no single size to pad, so it is left as is."""


# ---------------------------------------------------------------------------------------------
# process world


def _world() -> dict[str, Any]:
    """Return PartialState's shared dict, building the state on first use (cheap on later calls)."""
    shared = PartialState._shared_state
    if not shared:
        PartialState()
    return shared


def _is_single(world: dict[str, Any]) -> bool:
    return world["num_processes"] == 1 or world["distributed_type"] == "NO"


def _is_xla(world: dict[str, Any]) -> bool:
    return world["distributed_type"] == "XLA"


# ---------------------------------------------------------------------------------------------
# debug mode: compare every rank's shapes before a collective (the outline: _ops_packing._signature)


def _verify(op: str, data: Any, world: dict[str, Any], sizes_must_match: bool = True) -> None:
    """Raise DistributedOperationException when ``data``'s shapes differ between the processes."""
    signature = _signature(data)
    everyone: list[Any] = [None] * world["num_processes"]
    dist.all_gather_object(everyone, signature)
    key = (lambda s: s) if sizes_must_match else _outline
    if all(key(s) == key(everyone[0]) for s in everyone):
        return
    what = "shapes and dtypes" if sizes_must_match else "structure, number of dimensions and dtypes"
    per_rank = "\n".join(f"  - Process {i}: {_render(s)}" for i, s in enumerate(everyone))
    raise DistributedOperationException(
        f"Cannot apply `{op}`: the tensors' {what} differ between processes, so the collective would hang "
        f"or mix up data. Every process must pass the same {what}.\n"
        f"Operation: `notebook_accel.utils.operations.{op}`\nInput shapes:\n{per_rank}"
    )


# ---------------------------------------------------------------------------------------------
# gather


def _gather_one(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    tensor = tensor.detach()  # collectives move data; autograd would reject the in-place receive
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    tensor = tensor.contiguous()
    out = torch.empty(
        (world_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    _all_gather_into(_wire(out), _wire(tensor))
    return out


def _gather_many(tensors: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    out: list[Any] = [None] * len(tensors)
    for (device, dtype), idx in _groups(tensors).items():
        if len(idx) == 1:
            out[idx[0]] = _gather_one(tensors[idx[0]], world_size)
            continue
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        received = torch.empty(world_size * flat.numel(), dtype=dtype, device=device)
        _all_gather_into(_wire(received), _wire(flat))
        rows = received.view(world_size, flat.numel())
        offset = 0
        for i in idx:
            t = tensors[i]
            n = t.numel()
            block = rows[:, offset : offset + n]
            shape = (world_size * t.shape[0], *t.shape[1:]) if t.ndim else (world_size,)
            out[i] = block.reshape(shape)
            offset += n
    return out


def gather(tensor: Any) -> Any:
    """Return the tensors of ``tensor`` (nested lists/tuples/dicts) gathered from every process.

    Each result is the concatenation along dim 0 of every process's tensor (0-dim tensors become
    1-dim of length ``num_processes``). With one process, ``tensor`` is returned as it is.
    """
    world = _world()
    if _is_single(world):
        return tensor
    if world["debug"]:
        _verify("gather", tensor, world)
    if isinstance(tensor, torch.Tensor) and not _is_xla(world):
        return _gather_one(tensor, world["num_processes"])
    tensors = _leaves(tensor, "gather")
    if _is_xla(world):
        import torch_xla.core.xla_model as xm

        return _refill(tensor, [xm.all_gather(t.reshape(1) if t.ndim == 0 else t) for t in tensors])
    return _refill(tensor, _gather_many(tensors, world["num_processes"]))


def gather_object(object: Any) -> list:
    """Return a list of the objects of every process: lists and tuples are concatenated, others appended.

    With one process, a list is returned as it is, a tuple as a list and any other object as ``[object]``.
    """
    world = _world()
    if _is_single(world):
        return object if isinstance(object, list) else list(object) if isinstance(object, tuple) else [object]
    if _is_xla(world):
        raise RuntimeError(
            "gather_object is not supported on XLA (TPU): gather tensors with gather() instead"
        )
    everyone: list[Any] = [None] * world["num_processes"]
    dist.all_gather_object(everyone, object)
    out: list[Any] = []
    for item in everyone:
        if isinstance(item, (list, tuple)):
            out.extend(item)
        else:
            out.append(item)
    return out


# ---------------------------------------------------------------------------------------------
# broadcast


def _check_source(from_process: Any, world: dict[str, Any]) -> None:
    n = world["num_processes"]
    if isinstance(from_process, bool) or not isinstance(from_process, int) or not 0 <= from_process < n:
        raise ValueError(f"from_process={from_process!r} is not a process index: use an int in [0, {n - 1}]")


def _broadcast_into(tensor: torch.Tensor, src: int) -> None:
    tensor = tensor.detach()  # shares storage: the caller's tensor is still updated in place
    if tensor.is_contiguous():
        dist.broadcast(_wire(tensor), src=src)
        return
    buffer = tensor.contiguous()
    dist.broadcast(_wire(buffer), src=src)
    with torch.no_grad():
        tensor.copy_(buffer)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Return ``tensor`` (nested lists/tuples/dicts) after copying process ``from_process``'s values into it.

    The tensors are updated in place on the receiving processes, so every process must pass tensors
    of the same shapes and dtypes.
    """
    world = _world()
    _check_source(from_process, world)
    if _is_single(world):
        return tensor
    if world["debug"]:
        _verify("broadcast", tensor, world)
    if isinstance(tensor, torch.Tensor) and not _is_xla(world):
        _broadcast_into(tensor, from_process)
        return tensor
    tensors = _leaves(tensor, "broadcast")
    if _is_xla(world):
        import torch_xla.core.xla_model as xm

        xm.collective_broadcast(tensors, root_ordinal=from_process)
        return tensor
    is_source = world["process_index"] == from_process
    for (device, dtype), idx in _groups(tensors).items():
        if len(idx) == 1:
            _broadcast_into(tensors[idx[0]], from_process)
            continue
        if is_source:
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        else:
            flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=dtype, device=device)
        dist.broadcast(_wire(flat), src=from_process)
        if is_source:
            continue
        offset = 0
        with torch.no_grad():
            for i in idx:
                t = tensors[i]
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
    return tensor


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Return ``object_list`` after replacing its items, in place, by those of process ``from_process``."""
    if not isinstance(object_list, list):
        raise TypeError(
            f"broadcast_object_list expects a list (updated in place), got {type(object_list).__name__}"
        )
    world = _world()
    _check_source(from_process, world)
    if _is_single(world):
        return object_list
    if _is_xla(world):
        raise RuntimeError("broadcast_object_list is not supported on XLA (TPU): broadcast tensors instead")
    dist.broadcast_object_list(object_list, src=from_process)
    return object_list


# ---------------------------------------------------------------------------------------------
# reduce


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Return the tensors of ``tensor`` (nested lists/tuples/dicts) reduced over all processes.

    ``reduction`` is "mean" (integer and bool tensors give a float mean), "sum" (bool tensors give
    int64 counts), "max", "min" (element-wise over processes) or "none" (no reduction: the input is
    returned). ``scale`` multiplies the result on XLA only, as documented by Accelerate. The
    input is never modified; with one process it is returned as it is.

    Args:
        tensor: A tensor or nested lists/tuples/dicts of tensors.
        reduction: "mean" (default), "sum" or "none".
        scale: A factor applied to the result on XLA only.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"Unknown reduction {reduction!r}: use one of {', '.join(map(repr, _REDUCTIONS))}")
    world = _world()
    if _is_single(world) or reduction == "none":
        return tensor
    if world["debug"]:
        _verify("reduce", tensor, world)
    n = world["num_processes"]
    kind = _REDUCTIONS[reduction]
    if isinstance(tensor, torch.Tensor) and not _is_xla(world):
        tensor = tensor.detach()
        buffer = (
            tensor.long()
            if tensor.dtype == torch.bool
            else tensor.clone(memory_format=torch.contiguous_format)
        )
        dist.all_reduce(buffer, op=_REDUCE_OPS[kind])
        return _mean(buffer, n) if reduction == "mean" else buffer
    # Booleans are summed as counts (int64): the sum of True over processes, or its mean.
    tensors = [t.long() if t.dtype == torch.bool else t.detach() for t in _leaves(tensor, "reduce")]
    if _is_xla(world):
        import torch_xla.core.xla_model as xm

        summed = [t.clone() for t in tensors]
        xm.all_reduce(kind, summed, scale=scale)
        return _refill(tensor, [_mean(t, n) if reduction == "mean" else t for t in summed])
    out: list[Any] = [None] * len(tensors)
    for idx in _groups(tensors).values():
        if len(idx) == 1:
            buffer = tensors[idx[0]].clone(memory_format=torch.contiguous_format)
        else:
            buffer = torch.cat([tensors[i].reshape(-1) for i in idx])
        dist.all_reduce(buffer, op=_REDUCE_OPS[kind])
        if reduction == "mean":
            buffer = _mean(buffer, n)
        if len(idx) == 1:
            out[idx[0]] = buffer
            continue
        offset = 0
        for i in idx:
            t = tensors[i]
            out[i] = buffer[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
    return _refill(tensor, out)


def _mean(buffer: torch.Tensor, n: int) -> torch.Tensor:
    if buffer.is_floating_point() or buffer.is_complex():
        return buffer.div_(n)
    return buffer / n


# ---------------------------------------------------------------------------------------------
# pad_across_processes


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Return ``tensor`` (nested lists/tuples/dicts) padded along ``dim`` to the largest size of any process.

    Padding uses the value ``pad_index``, at the end (or the start with ``pad_first=True``). One
    collective exchanges the sizes of every tensor; tensors already of the largest size, and tensors
    with fewer than ``dim + 1`` dimensions, are returned as they are.

    Args:
        tensor: A tensor or nested lists/tuples/dicts of tensors.
        dim: The dimension to pad (default 0).
        pad_index: The value padding is filled with (default 0).
        pad_first: Pad at the start instead of the end.
    """
    world = _world()
    if _is_single(world):
        if _has_nested(tensor):
            _warn_nested()  # as with several processes, so a script sees it on its first run
        return tensor
    tensors = [tensor] if isinstance(tensor, torch.Tensor) else _leaves(tensor, "pad_across_processes")
    if any(t.is_nested for t in tensors):
        return _pad_without_nested(tensor, tensors, dim, pad_index, pad_first)
    if world["debug"]:
        _verify("pad_across_processes", tensor, world, sizes_must_match=False)
    if not tensors:
        return tensor
    dims = [dim + t.ndim if dim < 0 else dim for t in tensors]
    # Size -1 marks a tensor with too few dimensions: it still takes part in the one collective, so
    # a process whose tensor differs there cannot leave the others waiting.
    local = [t.shape[d] if 0 <= d < t.ndim else -1 for t, d in zip(tensors, dims)]
    n = world["num_processes"]
    backend = world.get("backend")
    device = world["device"] if backend and "nccl" in backend else None
    sizes = torch.tensor(local, dtype=torch.int64, device=device)
    everyone = torch.empty(n * len(local), dtype=torch.int64, device=device)
    _all_gather_into(everyone, sizes)
    largest = everyone.tolist() if len(local) == 1 else everyone.view(n, len(local)).amax(dim=0).tolist()
    if len(local) == 1:
        largest = [max(largest)]
    out = []
    for t, d, size, target in zip(tensors, dims, local, largest):
        if size < 0 or size == target:
            out.append(t)
            continue
        shape = list(t.shape)
        shape[d] = target
        padded = t.new_full(shape, pad_index)
        padded.narrow(d, target - size if pad_first else 0, size).copy_(t)
        out.append(padded)
    return out[0] if isinstance(tensor, torch.Tensor) else _refill(tensor, out)


def _pad_without_nested(
    tensor: Any, tensors: list[torch.Tensor], dim: int, pad_index: int, pad_first: bool
) -> Any:
    """Return ``tensor`` padded with its nested tensors left out (each warned about)."""
    _warn_nested()
    # Every process still pads its regular tensors in one collective; nested ones are placeholders.
    regular = [t[0] if t.is_nested else t for t in tensors]
    padded = pad_across_processes(regular, dim=dim, pad_index=pad_index, pad_first=pad_first)
    out = [t if t.is_nested else p for t, p in zip(tensors, padded)]
    return out[0] if isinstance(tensor, torch.Tensor) else _refill(tensor, out)


def _has_nested(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return data.is_nested
    if isinstance(data, (list, tuple)):
        return any(map(_has_nested, data))
    if isinstance(data, Mapping):
        return any(map(_has_nested, data.values()))
    return False


def _warn_nested() -> None:
    warnings.warn(
        "pad_across_processes cannot pad nested tensors (their sizes differ per row); they are returned "
        "unpadded. Pad them yourself (torch.nested.to_padded_tensor) before gathering if you need equal sizes.",
        CannotPadNestedTensorWarning,
        stacklevel=4,
    )


# ---------------------------------------------------------------------------------------------
# tensors that exist on one process only (the others pass None)


def _source(tensor: torch.Tensor | None, op: str) -> tuple[int, tuple[int, ...], torch.dtype]:
    """Return ``(rank, shape, dtype)`` of the one process that holds a tensor (ValueError otherwise)."""
    mine = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    holders = [rank for rank, info in enumerate(everyone) if info is not None]
    if len(holders) != 1:
        raise ValueError(
            f"{op}: exactly one process must pass a tensor and the others None; processes {holders} passed "
            "one. Pass the tensor on one process only (e.g. `t if state.is_main_process else None`)."
        )
    shape, dtype = everyone[holders[0]]
    return holders[0], shape, dtype


def _check_single_process_input(tensor: torch.Tensor | None, op: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: a single process must pass a tensor, got {tensor!r}")
    return tensor


def gather_tensor_shape(tensor: torch.Tensor | None) -> torch.Tensor:
    """Return, on every process, the shape (an int64 tensor) of the tensor that one process holds."""
    world = _world()
    if _is_single(world):
        return torch.tensor(
            _check_single_process_input(tensor, "gather_tensor_shape").shape, dtype=torch.int64
        )
    _, shape, _ = _source(tensor, "gather_tensor_shape")
    return torch.tensor(shape, dtype=torch.int64)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Return, on every process, a copy (on its device) of the tensor that one process holds; others pass None."""
    world = _world()
    if _is_single(world):
        return _check_single_process_input(tensor, "copy_tensor_to_devices")
    src, shape, dtype = _source(tensor, "copy_tensor_to_devices")
    backend = world.get("backend") or ""
    device = world["device"] if "nccl" in backend or "xccl" in backend else torch.device("cpu")
    buffer = (
        tensor.to(device).contiguous()
        if tensor is not None
        else torch.empty(shape, dtype=dtype, device=device)
    )
    wire = buffer.view(torch.uint8) if buffer.dtype == torch.bool else buffer
    dist.broadcast(wire, src=src)
    return buffer.to(world["device"])


# ---------------------------------------------------------------------------------------------
# decorators: check a collective's input, name the failed operation


def verify_operation(function: Callable) -> Callable:
    """Return ``function`` (a collective taking a tensor structure first) checked across processes in debug mode.

    With ``ACCELERATE_DEBUG_MODE`` on (``PartialState().debug``), every process first compares the
    shapes and dtypes of its first argument; a mismatch raises DistributedOperationException listing
    each process's shapes instead of hanging in the collective.
    """

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_inputs_agree(function.__name__, args, kwargs)
        return function(*args, **kwargs)

    return checked


def _check_inputs_agree(name: str, args: tuple, kwargs: dict) -> None:
    """In debug mode with several processes, compare the collective's first argument across them."""
    world = _world()
    if not world.get("debug") or _is_single(world):
        return
    first = args[0] if args else next(iter(kwargs.values()), None)
    _verify(name, first, world)


def chained_operation(function: Callable) -> Callable:
    """Return ``function`` with a DistributedOperationException re-raised naming ``function`` (the cause chained)."""

    @functools.wraps(function)
    def named(*args: Any, **kwargs: Any) -> Any:
        return _call_naming_failure(function, args, kwargs)

    return named


def _call_naming_failure(function: Callable, args: tuple, kwargs: dict) -> Any:
    try:
        return function(*args, **kwargs)
    except DistributedOperationException as cause:
        where = f"{function.__module__}.{function.__qualname__}"
        raise DistributedOperationException(
            f"`{where}` failed because the processes passed it mismatched inputs (each one's is listed in the "
            "cause above): make them match"
        ) from cause


def GatheredParameters(
    params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
) -> Any:  # noqa: N802 (Accelerate's name)
    """Return DeepSpeed's ``zero.GatheredParameters`` context under ZeRO-3, else a context that does nothing.

    Under ZeRO stage 3 each process holds a shard of ``params``; inside the context they are whole
    (and ``modifier_rank``'s changes are broadcast on exit). Without ZeRO-3 they are whole already.

    Args:
        params: The (sharded) parameters to gather.
        modifier_rank: The rank whose changes inside the context are kept and broadcast.
        fwd_module: A module whose forward may use the gathered parameters.
        enabled: Gather at all (default True).
    """
    zero3 = (
        parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
        and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    )
    if not (enabled and zero3):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(
        params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled
    )
