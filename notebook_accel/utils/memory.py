"""Out-of-memory handling: retry with smaller batches, free references and device caches."""

from __future__ import annotations

import functools
import gc
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from .imports import (
    is_cuda_available,
    is_hpu_available,
    is_mlu_available,
    is_mps_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_sdaa_available,
    is_xpu_available,
)

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
# Accelerate 1.15 serves these names at this path too (defined elsewhere).
__all__ += [
    "is_cuda_available",
    "is_hpu_available",
    "is_mlu_available",
    "is_mps_available",
    "is_musa_available",
    "is_neuron_available",
    "is_npu_available",
    "is_sdaa_available",
    "is_xpu_available",
]

logger = logging.getLogger(__name__)

# Messages of the allocator / kernel errors that mean "this batch does not fit".
_OOM_MESSAGES = (
    "CUDA out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
    "XPU out of memory.",
    "NPU out of memory.",
    "MLU out of memory.",
    "MPS backend out of memory",
    "HIP out of memory.",
    "CPU out of memory.",
    "SDAA out of memory.",
    "MUSA out of memory.",
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return nothing; empty the caching allocator of every device in use (after ``gc.collect()`` if asked).

    Only backends already initialised are touched, so this never initialises CUDA.
    """
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and hasattr(xpu, "is_initialized") and xpu.is_initialized():
        xpu.empty_cache()
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "empty_cache"):
        npu.empty_cache()
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Return a list of ``None`` (one per object) after dropping the references and clearing caches.

    Use as ``a, b = release_memory(a, b)`` so the caller's names stop holding the objects.
    """
    released: list[Any] = list(objects)
    for i in range(len(released)):
        released[i] = None
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Return whether ``exception`` is an out-of-memory error that a smaller batch could avoid.

    As in Accelerate 1.15 only the allocator's message decides (``torch.OutOfMemoryError`` is a
    RuntimeError carrying one); a Python ``MemoryError`` is not retried: it propagates.
    """
    if (
        isinstance(exception, RuntimeError)
        and len(exception.args) == 1
        and isinstance(exception.args[0], str)
    ):
        return any(message in exception.args[0] for message in _OOM_MESSAGES)
    return False


def _reduced(batch_size: int, reduce_batch_size_fn: Callable[[], int] | None) -> int:
    """Return the next batch size to try after ``batch_size`` ran out of memory."""
    if reduce_batch_size_fn is None:
        return int(batch_size * 0.9)
    smaller = reduce_batch_size_fn()
    if isinstance(smaller, bool) or not isinstance(smaller, int) or smaller < 0:
        raise TypeError(f"reduce_batch_size_fn must return a batch size (an int >= 0), got {smaller!r}")
    return smaller


def find_executable_batch_size(
    function: Callable = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable:
    """Return ``function`` wrapped so it is retried with a smaller batch size after each out-of-memory error.

    Usable as ``@find_executable_batch_size`` or ``@find_executable_batch_size(starting_batch_size=64)``;
    callers pass the arguments after ``batch_size``. Raises RuntimeError when the batch size reaches zero;
    the last working size is kept for later calls. Example::

        @find_executable_batch_size(starting_batch_size=128)
        def train(batch_size, model, optimizer): ...

        train(model, optimizer)

    Args:
        function: The function to retry; its first parameter is ``batch_size``.
        starting_batch_size: The first batch size tried (default 128).
        reduce_batch_size_fn: Called with no arguments after an out-of-memory error, it returns the next batch
            size (default: 90% of the last, rounded down).
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    if not callable(function):
        raise TypeError(f"find_executable_batch_size decorates a function, got {function!r}")
    # 0 is accepted here, as in Accelerate: calling then raises "No executable batch size found".
    if (
        isinstance(starting_batch_size, bool)
        or not isinstance(starting_batch_size, int)
        or starting_batch_size < 0
    ):
        raise ValueError(f"starting_batch_size must be an int >= 0, got {starting_batch_size!r}")
    if reduce_batch_size_fn is not None and not callable(reduce_batch_size_fn):
        raise TypeError(
            f"reduce_batch_size_fn must be a callable taking no arguments, got {reduce_batch_size_fn!r}"
        )
    name = getattr(function, "__name__", repr(function))
    params = list(inspect.signature(function).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in positional or params[0].name != "batch_size":
        raise TypeError(
            f"`{name}` must take `batch_size` as its first parameter to be decorated with "
            f"find_executable_batch_size, e.g. `def {name}(batch_size, ...)`"
        )
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    n_positional = sum(p.kind in positional for p in params)
    batch_size = starting_batch_size

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        if "batch_size" in kwargs or (not takes_varargs and len(args) + 1 > n_positional):
            given = ", ".join(f"{p.name}={v!r}" for p, v in zip(params[1:], args[1:]))
            raise TypeError(
                f"Batch size was passed into `{name}` when called; the decorator already supplies it. "
                f"Call it without the batch size: `{name}({given})`"
            )
        clear_device_cache(garbage_collection=True)
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
            # Freed only here, after the except block: inside it the exception being handled still
            # holds the failed attempt's frames, and with them its tensors.
            smaller = _reduced(batch_size, reduce_batch_size_fn)
            logger.info("out of memory at batch_size=%d, retrying with %d", batch_size, smaller)
            clear_device_cache(garbage_collection=True)
            batch_size = smaller

    return decorator
