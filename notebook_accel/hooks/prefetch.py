"""Prefetching offload: load block i+1's weights on a background thread while block i computes.

One :class:`Prefetcher` serves all the offloading :class:`~notebook_accel.hooks.AlignDevicesHook`
of a model (``dispatch_model``, ``cpu_offload``, ``disk_offload`` and
``load_checkpoint_and_dispatch`` create it; :func:`enable_prefetch` does it for hooks attached by
hand). It learns the execution order as the model runs: the hook loaded after hook A is A's
successor (module order is the first guess), so a model whose forward does not follow its module
order is prefetched correctly from its second forward on, and a wrong guess only costs the
discarded load.

Memory stays bounded: at most ``depth`` blocks (default 1) are loaded ahead of the one running.
A load that fails in the background is dropped and redone in the forward's thread, where its
exception surfaces normally. The worker thread is joined when the last hook is removed
(``remove_hook_from_submodules``) or on :meth:`Prefetcher.close`.

What a background load does depends on the hook:

- weights that need a copy (to a GPU, a dtype cast, or ``zero_copy=False``) are copied; for CUDA
  through pinned host memory (torch's caching host allocator) on a side stream, with an event the
  compute stream waits on, so transfers overlap compute;
- weights used in place (memory-mapped or in-memory CPU tensors on a CPU execution device) need no
  copy: the worker only faults their pages in (one read per 4 KiB page), so a cold page cache is
  read from disk ahead of the compute instead of during it;
- copies for a CPU execution device (``zero_copy=False``, dtype casts) are not made ahead unless
  ``cpu_copies=True``: a background copy competes with the compute for cores and memory bandwidth
  and was measured slower than copying in the forward's thread (1.44x-1.64x vs 1.17x-1.20x the
  plain model in ``benchmarks/bench_offload.py`` on 2 cores, with 1 or 2 torch threads); the worker
  then only faults the pages in. Using the weights in place (the default) beats both.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from .offloaded import find_align_hook

__all__ = ["Prefetcher", "enable_prefetch", "THREAD_NAME_PREFIX", "PAGES_READY"]

logger = logging.getLogger(__name__)

THREAD_NAME_PREFIX = "notebook_accel-prefetch"

PAGES_READY = "pages-ready"
"""What :meth:`Prefetcher.take` returns for a zero-copy hook whose pages were faulted in ahead."""


class Prefetcher:
    """Background loader of the next offloaded blocks' weights (see the module docstring)."""

    def __init__(self, depth: int = 1, cpu_copies: bool = False) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"Prefetch depth must be an int >= 1, got {depth!r}")
        self.depth = depth
        self.cpu_copies = cpu_copies
        """Copy ahead for a CPU execution device too (off by default: it competes with the compute)."""
        self._hooks: list[Any] = []
        self._next: dict[int, Any] = {}
        self._last: Any = None
        self._pending: dict[int, Future] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.closed = False
        self.hits = 0
        """Loads served by the worker (copies made ahead, or pages faulted in ahead)."""
        self.misses = 0
        """Loads the forward's thread had to do itself."""

    # -- registration ------------------------------------------------------------------------
    def register(self, hook: Any) -> None:
        """Serve ``hook``; hooks registered in turn are first guessed to run in that order."""
        if self.closed:
            raise RuntimeError("This Prefetcher is closed; create a new one (enable_prefetch).")
        if self._hooks:
            self._next[id(self._hooks[-1])] = hook
        self._hooks.append(hook)
        hook._prefetcher = self

    def unregister(self, hook: Any) -> None:
        """Stop serving ``hook``; the worker thread is joined once no hook is left."""
        hook._prefetcher = None
        self._pending.pop(id(hook), None)
        self._next.pop(id(hook), None)
        for key, successor in list(self._next.items()):
            if successor is hook:
                del self._next[key]
        self._hooks = [h for h in self._hooks if h is not hook]
        if self._last is hook:
            self._last = None
        if not self._hooks:
            self.close()

    @property
    def alive_threads(self) -> list[threading.Thread]:
        """Return this prefetcher's worker threads that are still running (none once closed)."""
        return [t for t in self._threads if t.is_alive()]

    @property
    def hooks(self) -> list[Any]:
        """Return the hooks served, in registration order."""
        return list(self._hooks)

    def close(self) -> None:
        """Drop pending loads and join the worker thread (idempotent)."""
        self.closed = True
        pending, self._pending = self._pending, {}
        for future in pending.values():
            future.cancel()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        for hook in self._hooks:
            hook._prefetcher = None
        self._hooks = []

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- called by the hooks (forward thread) --------------------------------------------------
    def take(self, hook: Any) -> list[torch.Tensor] | str | None:
        """Return the weights prefetched for ``hook`` (waiting for the load to finish), ``PAGES_READY`` or None."""
        future = self._pending.pop(id(hook), None)
        if future is None:
            self.misses += 1
            return None
        try:
            result = future.result()
        except Exception as exc:  # redone synchronously by the caller, where the error surfaces
            logger.debug("prefetch of %r failed (%s); loading synchronously", hook.module_name, exc)
            self.misses += 1
            return None
        if result is None:  # pages were faulted in; the load itself is free
            self.hits += 1
            return PAGES_READY
        values, event = result
        if event is not None:
            stream = torch.cuda.current_stream(hook._device)
            stream.wait_event(event)
            for value in values:
                if value.is_cuda:
                    value.record_stream(stream)
        self.hits += 1
        return values

    def schedule_after(self, hook: Any) -> None:
        """Note that ``hook`` just loaded (learning the order) and start loading its successors."""
        if self.closed:
            return
        last = self._last
        if last is not None and last is not hook:
            self._next[id(last)] = hook
        self._last = hook
        targets = []
        current = hook
        for _ in range(self.depth):
            current = self._next.get(id(current))
            if current is None or current is hook or current in targets:
                break
            targets.append(current)
        wanted = {id(t) for t in targets}
        for key in [k for k in self._pending if k not in wanted]:
            self._pending.pop(key).cancel()  # a wrong guess: drop it to keep memory bounded
        for target in targets:
            if id(target) not in self._pending and not target._loaded and target._slots:
                self._pending[id(target)] = self._submit(target)

    # -- worker side ---------------------------------------------------------------------------
    def _submit(self, hook: Any) -> Future:
        with self._lock:
            if self._executor is None:
                # The initializer holds the thread list, not ``self``: an idle worker must not keep
                # the prefetcher alive (its finalizer shuts the worker down).
                self._executor = ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix=THREAD_NAME_PREFIX,
                    initializer=functools.partial(_record_thread, self._threads),
                )
                weakref.finalize(self, self._executor.shutdown, wait=False, cancel_futures=True)
            executor = self._executor
        return executor.submit(self._work, hook)

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _work(self, hook: Any) -> tuple[list[torch.Tensor], Any] | None:
        device = hook._device
        on_cpu = device is None or device.type == "cpu"
        if not hook._needs_copy or (on_cpu and not self.cpu_copies):
            hook._touch()
            return None
        if device is not None and device.type == "cuda":
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                values = hook._fetch(non_blocking=True, pin=True)
                event = torch.cuda.Event()
                event.record(stream)
            return values, event
        return hook._fetch(), None


def _record_thread(threads: list[threading.Thread]) -> None:
    threads.append(threading.current_thread())


def enable_prefetch(model: nn.Module, depth: int = 1, cpu_copies: bool = False) -> Prefetcher | None:
    """Return a :class:`Prefetcher` serving every offloading hook of ``model`` (None if there is none).

    ``cpu_copies``: for a CPU execution device, whether weights that need a copy are copied ahead
    on the worker (default False; see the module docstring).

    Hooks already served by another prefetcher are moved to the new one.
    """
    hooks = []
    for module in model.modules():
        hook = find_align_hook(module)
        if hook is not None and hook.offload and hook._slots:
            hooks.append(hook)
    if not hooks:
        return None
    prefetcher = Prefetcher(depth=depth, cpu_copies=cpu_copies)
    for hook in hooks:
        if hook._prefetcher is not None:
            hook._prefetcher.unregister(hook)
        prefetcher.register(hook)
    return prefetcher
