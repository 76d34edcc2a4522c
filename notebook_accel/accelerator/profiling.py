"""``Accelerator.profile``: torch.profiler around a block of the training loop, one trace per rank.

Each rank profiles itself; with ``ProfileKwargs(output_trace_dir=...)`` rank N writes
``trace_rank<N>.json`` (Chrome trace format, open it in chrome://tracing or Perfetto) when the
block ends, so traces of a launch sit side by side without clobbering each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._lazy import LazyModule

if TYPE_CHECKING:
    from ..utils.kwargs import ProfileKwargs

__all__ = ["profile", "trace_path"]

logger = logging.getLogger(__name__)
# The handlers load at the first profiled block, not with the Accelerator.
_kwargs = LazyModule("notebook_accel.utils.kwargs")


def trace_path(output_trace_dir: str, process_index: int) -> str:
    """Return the Chrome trace file of rank ``process_index`` inside ``output_trace_dir``."""
    return os.path.join(output_trace_dir, f"trace_rank{process_index}.json")


@contextlib.contextmanager
def profile(handler: ProfileKwargs | None, process_index: int) -> Iterator[Any]:
    """Yield a running ``torch.profiler.profile`` built from ``handler`` (defaults when None); export on exit."""
    if handler is None:
        handler = _kwargs.ProfileKwargs()
    elif not isinstance(handler, _kwargs.ProfileKwargs):
        raise TypeError(f"profile_handler must be a ProfileKwargs, got {type(handler).__name__}")
    profiler = handler.build()
    with profiler:
        yield profiler
    if handler.output_trace_dir is not None:
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        path = trace_path(handler.output_trace_dir, process_index)
        profiler.export_chrome_trace(path)
        logger.info("profiler trace of rank %d written to %s", process_index, path)
