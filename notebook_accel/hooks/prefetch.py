"""Prefetching offload: load the next blocks' weights ahead while the current one computes.

One :class:`Prefetcher` serves all the offloading :class:`~notebook_accel.hooks.AlignDevicesHook`
of a model (``dispatch_model``, ``cpu_offload``, ``disk_offload`` and
``load_checkpoint_and_dispatch`` create it; :func:`enable_prefetch` does it for hooks attached by
hand). It learns the execution order as the model runs: the hook loaded after hook A is A's
successor (module order is the first guess), so a model whose forward does not follow its module
order is prefetched correctly from its second forward on, and a wrong guess only costs the
discarded load.

Hooks that run on a CUDA device are *streamed* (:meth:`Prefetcher.stream`, done by
:func:`enable_prefetch` and the big-model functions): their weights are packed and pinned once, and
copied on a side stream as far ahead as a GPU memory budget (the lookahead) allows; see
:mod:`notebook_accel.hooks.streaming`. The order they run in is learnt the same way.

Otherwise, memory stays bounded: at most ``depth`` blocks (default 1) are loaded ahead of the one
running. A load that fails in the background is dropped and redone in the forward's thread, where
its exception surfaces normally. The worker thread is joined when the last hook is removed
(``remove_hook_from_submodules``) or on :meth:`Prefetcher.close`.

What a background load does depends on the hook:

- weights that need a copy (a device other than CUDA, a dtype cast, or ``zero_copy=False``) are
  copied;
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
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from ..utils.device_planning.sizes import convert_file_size_to_int
from .align import AlignDevicesHook
from .host_pack import HostPinner, pin_limit
from .offloaded import find_align_hook
from .schedule import CopyEngine, ExecutionOrder
from .streaming import CudaCopyEngine, Streamer

__all__ = ["Prefetcher", "enable_prefetch", "THREAD_NAME_PREFIX", "PAGES_READY"]

logger = logging.getLogger(__name__)

THREAD_NAME_PREFIX = "notebook_accel-prefetch"

PAGES_READY = "pages-ready"
"""What :meth:`Prefetcher.take` returns for a zero-copy hook whose pages were faulted in ahead."""


class Prefetcher:
    """Background loader of the next offloaded blocks' weights (see the module docstring)."""

    def __init__(self, depth: int | None = 1, cpu_copies: bool = False) -> None:
        if depth is not None and (not isinstance(depth, int) or depth < 1):
            raise ValueError(f"Prefetch depth must be an int >= 1 (or None), got {depth!r}")
        self.depth = depth
        """Blocks loaded ahead: 1 with None on the CPU; streaming to a GPU, None means as many as the lookahead holds."""
        self.cpu_copies = cpu_copies
        """Copy ahead for a CPU execution device too (off by default: it competes with the compute)."""
        self._hooks: list[Any] = []
        self._order = ExecutionOrder()
        self._pending: dict[int, Future] = {}
        self.streamer: Streamer | None = None
        """The streamer serving the hooks that run on a GPU (None until :meth:`stream`)."""
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.closed = False
        self.hits = 0
        """Loads served by the worker (copies made ahead, or pages faulted in ahead)."""
        self.misses = 0
        """Loads the forward's thread had to do itself."""

    # -- registration ------------------------------------------------------------------------
    def register(self, hook: AlignDevicesHook) -> None:
        """Serve ``hook``; hooks registered in turn are first guessed to run in that order."""
        if self.closed:
            raise RuntimeError("This Prefetcher is closed; create a new one (enable_prefetch).")
        self._order.add(hook)
        self._hooks.append(hook)
        hook._prefetcher = self

    def unregister(self, hook: AlignDevicesHook) -> None:
        """Stop serving ``hook``; the worker thread is joined once no hook is left."""
        hook._prefetcher = None
        self._pending.pop(id(hook), None)
        self._order.remove(hook)
        if self.streamer is not None:
            self.streamer.remove(hook)
        self._hooks = [h for h in self._hooks if h is not hook]
        if not self._hooks:
            self.close()

    def stream(
        self,
        device: torch.device,
        *,
        lookahead: int | str | None = None,
        pin_memory: bool | int | str = True,
        groups: Iterable[tuple[str, list[Any]]] | None = None,
        owned: bool = False,
        engine: CopyEngine | None = None,
    ) -> Streamer:
        """Stream the registered hooks that run on ``device`` (see :mod:`notebook_accel.hooks.streaming`); return the streamer.

        Args:
            device: The CUDA device the hooks compute on.
            lookahead: Device bytes (or text like "2GiB") for the weights copied ahead, the pool every
                copy lands in. Default: :func:`~notebook_accel.hooks.streaming.default_lookahead` of the
                memory free now.
            pin_memory: Pin the in-memory offloaded weights once: True (all), False (none), or a size
                (at most that much; the rest goes through a pinned staging buffer).
            groups: ``(unit name, hooks)`` copied together, in their expected order (default: one unit
                per hook).
            owned: The hooks' weights maps belong to the library (their in-memory entries move into the
                pinned blocks instead of being copied there).
            engine: The copy engine (default: a :class:`~notebook_accel.hooks.streaming.CudaCopyEngine`).
        """
        if self.streamer is not None:
            raise RuntimeError("This Prefetcher streams already; create a new one (enable_prefetch).")
        device = torch.device(device)
        served = [hook for hook in self._hooks if hook._device == device]
        if groups is None:
            groups = [(hook.module_name, [hook]) for hook in served]
        groups = [(name, [h for h in hooks if h._device == device]) for name, hooks in groups]
        groups = [(name, hooks) for name, hooks in groups if hooks]
        if engine is None:
            engine = CudaCopyEngine(device, self._submit_call)
        # The engine knows how its device page-locks host memory (CUDA's by default).
        register = getattr(engine, "register_host", None)
        pinner = HostPinner(pin_limit(pin_memory), register, getattr(engine, "unregister_host", None))
        budget = None if lookahead is None else _lookahead_bytes(lookahead)
        self.streamer = Streamer(device, groups, engine, budget, self.depth, pinner, owned)
        return self.streamer

    @property
    def alive_threads(self) -> list[threading.Thread]:
        """Return this prefetcher's worker threads that are still running (none once closed)."""
        return [t for t in self._threads if t.is_alive()]

    @property
    def hooks(self) -> list[Any]:
        """Return the hooks served, in registration order."""
        return list(self._hooks)

    def close(self) -> None:
        """Drop pending loads, give the streamer's device buffers back and join the worker thread (idempotent)."""
        self.closed = True
        pending, self._pending = self._pending, {}
        for future in pending.values():
            future.cancel()
        streamer, self.streamer = self.streamer, None
        if streamer is not None:
            streamer.close()
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
    def take(self, hook: AlignDevicesHook) -> list[torch.Tensor] | str | None:
        """Return the weights prefetched for ``hook`` (waiting for the load to finish), ``PAGES_READY`` or None.

        A streamed hook always gets its weights (views of its unit's device buffer, the compute stream
        waiting for their copy); ``hits`` counts those whose copy was issued ahead.
        """
        streamer = self.streamer
        if streamer is not None and streamer.serves(hook):
            values, ahead = streamer.take(hook)
            if ahead:
                self.hits += 1
            else:
                self.misses += 1
            return values
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
        self.hits += 1
        return result

    def released(self, hook: AlignDevicesHook, output: object = None) -> None:
        """Note that ``hook`` released its weights after a forward that returned ``output`` (streamed hooks)."""
        if self.streamer is not None:
            self.streamer.released(hook, output)

    def schedule_after(self, hook: AlignDevicesHook) -> None:
        """Note that ``hook`` just loaded (learning the order) and start loading its successors."""
        if self.closed or (self.streamer is not None and self.streamer.serves(hook)):
            return  # a streamed hook's unit copied its successors ahead when it began
        self._order.observe(hook)
        streamer = self.streamer
        targets = []
        for target in self._order.ahead(hook):
            if len(targets) >= (self.depth or 1):
                break
            if streamer is None or not streamer.serves(target):  # a streamed hook's copy is the streamer's
                targets.append(target)
        wanted = {id(t) for t in targets}
        for key in [k for k in self._pending if k not in wanted]:
            self._pending.pop(key).cancel()  # a wrong guess: drop it to keep memory bounded
        for target in targets:
            if id(target) not in self._pending and not target._loaded and target._slots:
                self._pending[id(target)] = self._submit(target)

    # -- worker side ---------------------------------------------------------------------------
    def _submit(self, hook: AlignDevicesHook) -> Future:
        return self._submit_call(self._work, hook)

    def _submit_call(self, fn: Callable[..., object], *args: object) -> Future:
        """Run ``fn(*args)`` on the worker thread (started at first use); return its Future."""
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
        return executor.submit(fn, *args)

    def _work(self, hook: AlignDevicesHook) -> list[torch.Tensor] | None:
        # A GPU hook that is not streamed is copied here on the default stream, which orders it
        # before the computation; streamed hooks never come here.
        device = hook._device
        on_cpu = device is None or device.type == "cpu"
        if not hook._needs_copy or (on_cpu and not self.cpu_copies):
            hook._touch()
            return None
        return hook._fetch()


def _record_thread(threads: list[threading.Thread]) -> None:
    threads.append(threading.current_thread())


def enable_prefetch(
    model: nn.Module,
    depth: int | None = None,
    cpu_copies: bool = False,
    *,
    lookahead: int | str | None = None,
    pin_memory: bool | int | str = True,
    blocks: Iterable[str] | None = None,
    owned: bool = False,
) -> Prefetcher | None:
    """Return a :class:`Prefetcher` serving every offloading hook of ``model`` (None if there is none).

    Hooks already served by another prefetcher are moved to the new one. Hooks that run on a CUDA
    device are streamed (:meth:`Prefetcher.stream`; with several devices, those of the first one).

    Args:
        model: The hooked model.
        depth: Blocks loaded ahead (None: 1 on the CPU; streaming, as many as ``lookahead`` holds).
        cpu_copies: For a CPU execution device, whether weights that need a copy are copied ahead on
            the worker (default False; see the module docstring).
        lookahead: Streaming: GPU bytes (or text like "2GiB") for the weights copied ahead (default:
            :func:`~notebook_accel.hooks.streaming.default_lookahead`).
        pin_memory: Streaming: pin the in-memory offloaded weights once (True), not at all (False), or
            up to a size.
        blocks: Streaming: module names whose offloaded weights are copied as one unit (a device map's
            entries); a hook outside them is a unit of its own.
        owned: Streaming: the weights maps are the library's own (cpu_offload / dispatch_model made
            them), so their in-memory entries move into the pinned blocks rather than being copied.
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
    gpu = next((h._device for h in hooks if h._device is not None and h._device.type == "cuda"), None)
    if gpu is not None:
        groups = _groups([h for h in hooks if h._device == gpu], blocks)
        prefetcher.stream(gpu, lookahead=lookahead, pin_memory=pin_memory, groups=groups, owned=owned)
    return prefetcher


def _groups(hooks: list[Any], blocks: Iterable[str] | None) -> list[tuple[str, list[Any]]]:
    """Return ``(unit name, hooks)``: each hook joins the innermost of ``blocks`` holding its module, in first-seen order."""
    names = set(blocks or ())
    groups: dict[str, list[Any]] = {}
    for hook in hooks:
        name = hook.module_name
        unit = name
        probe = name
        while names:
            if probe in names:
                unit = probe
                break
            if not probe:
                break
            probe = probe.rpartition(".")[0]
        groups.setdefault(unit, []).append(hook)
    return list(groups.items())


def _lookahead_bytes(lookahead: int | str) -> int:
    """Return the lookahead budget in bytes; raise ValueError naming a bad one."""
    try:
        budget = convert_file_size_to_int(lookahead)
    except (ValueError, TypeError):
        budget = -1
    if isinstance(lookahead, bool) or budget <= 0:
        raise ValueError(
            f"lookahead={lookahead!r} is not a size: give the GPU bytes for the weights copied ahead, as a "
            "number > 0 or text like '2GiB' (or None for the default)"
        )
    return budget
