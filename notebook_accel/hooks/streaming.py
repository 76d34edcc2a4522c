"""Streaming offload: offloaded weights copied to the GPU ahead of their use, at the speed of the bus.

The prefetcher hands a model's offloading hooks to a :class:`Streamer` when they run on a CUDA
device. The streamer groups them into units (:mod:`.host_pack`: one packed, pinned host block per
unit), and a :class:`~notebook_accel.hooks.schedule.StreamSchedule` decides which copies are in
flight; the :class:`CudaCopyEngine` carries them out:

- copies run on a side stream, each recording an event; the compute stream waits for the event of
  the unit it is about to run, never for the whole copy stream;
- device buffers come from a pool bounded by the lookahead budget: a buffer whose unit has run is
  rewritten for a later unit once the compute stream has passed the point recorded after that unit
  (an event), so nothing is allocated per forward. Buffers are allocated on the side stream and
  ``record_stream``-ed on the compute stream, so one that leaves the pool (handed over to autograd
  in a training step, or released when the pool shrinks) is only reused by the allocator once the
  computation reading it is done;
- pinned units are one ``cudaMemcpyAsync`` issued from the forward's thread; staged units (disk
  pages, blocks the host could not pin) are read into a pinned staging buffer on the prefetcher's
  worker thread, which then issues the copy; the compute stream waits for it the same way.

A hook's tensors are views of its unit's buffer while it runs. The unit ends when all its hooks
have run (or when another unit starts while none of its hooks is running); if a tensor of the
buffer outlives the computation (autograd saved it for the backward pass, or an output is a view
of a weight), the buffer is handed over instead of reused.

With a telemetry subscriber, the engine also times each copy and each wait of the compute stream
with CUDA events and reports them as ``"transfer"`` and ``"wait"`` events once they completed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from . import events
from .host_pack import HostPinner, StreamUnit, cuda_register, cuda_unregister, pack_unit
from .schedule import CopyEngine, StreamSchedule

if TYPE_CHECKING:
    from .align import AlignDevicesHook

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "CudaCopyEngine",
    "Streamer",
    "default_lookahead",
    "escapes",
    "measure_pinned_bandwidth",
]

logger = logging.getLogger(__name__)

DEFAULT_LOOKAHEAD = 256 * 2**20
"""With no ``lookahead`` given: at least this many bytes (and three units) ahead, within half the free memory."""


def default_lookahead(free_bytes: int, largest_unit: int) -> int:
    """Return the lookahead budget used when none is given.

    Three of the largest units (two keep the copy stream busy while one computes; the third absorbs
    a slow unit), at least ``DEFAULT_LOOKAHEAD``, at most half of ``free_bytes`` (the device memory
    free once the resident part is placed: the other half is left to activations), and never
    less than one unit.
    """
    wanted = max(3 * largest_unit, DEFAULT_LOOKAHEAD)
    return max(largest_unit, min(wanted, free_bytes // 2))


def escapes(output: object, buffer: torch.Tensor, depth: int = 3) -> bool:
    """Return whether ``output`` keeps tensors of ``buffer`` alive past the forward.

    True when autograd recorded the forward (an output requires grad with grad mode on: the weights
    may be saved for the backward pass), or when an output tensor shares ``buffer``'s storage.
    """
    grad = torch.is_grad_enabled()
    pointer = buffer.untyped_storage().data_ptr()
    pending = [(output, 0)]
    while pending:
        value, level = pending.pop()
        if isinstance(value, torch.Tensor):
            if (grad and value.requires_grad) or value.untyped_storage().data_ptr() == pointer:
                return True
        elif level < depth and isinstance(value, (list, tuple)):
            pending.extend((v, level + 1) for v in value)
        elif level < depth and isinstance(value, Mapping):
            pending.extend((v, level + 1) for v in value.values())
    return False


class _Ticket:
    """A copy issued (its event), or to be issued by the worker (a future of its event)."""

    __slots__ = ("event", "future")

    def __init__(self, event: torch.cuda.Event | None = None, future: Future | None = None) -> None:
        self.event = event
        self.future = future

    def resolve(self) -> Any:
        """Return the copy's event (waiting for the worker to issue it)."""
        if self.event is None and self.future is not None:
            self.event = self.future.result()
        return self.event


class _Stager:
    """Pinned staging buffers (two, used in turn) through which staged units reach the device."""

    def __init__(self, nbytes: int, pinner: HostPinner, count: int = 2) -> None:
        self.blocks = [pinner.block(nbytes) for _ in range(count)]
        self.done: list[Any] = [None] * count
        self.turn = 0

    def stage(self, unit: StreamUnit) -> tuple[torch.Tensor, int]:
        """Return the staging bytes holding ``unit``'s staged spans, and which buffer it is (worker thread)."""
        index = self.turn
        self.turn = (index + 1) % len(self.blocks)
        if self.done[index] is not None:
            self.done[index].synchronize()  # its previous copy to the device has read it
        start, end = unit.staged_range
        staging = self.blocks[index].bytes
        for read, offset in unit.staged:
            data = read()
            staging[offset - start : offset - start + data.numel()].copy_(data)
        return staging[: end - start], index


class CudaCopyEngine:
    """The :class:`~notebook_accel.hooks.schedule.CopyEngine` of a CUDA device (see the module docstring).

    ``submit(fn, *args)`` runs ``fn`` on the prefetcher's worker thread and returns a Future (staged units).
    """

    register_host = staticmethod(cuda_register)
    unregister_host = staticmethod(cuda_unregister)

    def __init__(self, device: torch.device, submit: Callable[..., Future]) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._submit = submit
        self._stager: _Stager | None = None
        self._lock = threading.Lock()
        self._timings: list[tuple[str, str, str, int, Any, Any]] = []
        self.released_bytes = 0
        """Bytes of buffers given back to the allocator (the pool shrank or closed)."""
        self.handed_over_bytes = 0
        """Bytes of buffers left to autograd or to an output after their unit ran."""

    def prepare(self, units: list[StreamUnit], pinner: HostPinner) -> None:
        """Allocate the staging buffers the staged units need (once, before the first copy)."""
        staged = max((unit.staged_bytes for unit in units), default=0)
        if staged:
            self._stager = _Stager(staged, pinner)

    def free_memory(self) -> int:
        """Return the bytes free on the device now (the default lookahead is taken from them)."""
        return torch.cuda.mem_get_info(self.device)[0]

    def _compute(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def allocate(self, nbytes: int) -> torch.Tensor:
        # Never an inference tensor (a first forward under inference_mode): the pool serves training too.
        with torch.cuda.stream(self.stream), torch.inference_mode(False):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer.record_stream(self._compute())  # freed later: reused only after the computation read it
        return buffer

    def _wait_for(self, after: _Ticket | torch.cuda.Event | None) -> None:
        """Make the copy stream wait for ``after`` (a mark, a ticket or None)."""
        if isinstance(after, _Ticket):
            after = after.resolve()
        if after is not None:
            self.stream.wait_event(after)

    def copy(
        self, unit: StreamUnit, buffer: torch.Tensor, after: _Ticket | torch.cuda.Event | None
    ) -> _Ticket:
        if unit.staged:
            return _Ticket(future=self._submit(self._staged_copy, unit, buffer, after))
        with torch.cuda.stream(self.stream):
            self._wait_for(after)
            timing = self._start_timing()
            for host, offset in unit.direct:
                buffer[offset : offset + host.numel()].copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._end_timing(timing, "transfer", unit, unit.nbytes, self.stream)
        return _Ticket(event)

    def _staged_copy(
        self, unit: StreamUnit, buffer: torch.Tensor, after: _Ticket | torch.cuda.Event | None
    ) -> torch.cuda.Event:
        """Read the staged spans into a staging buffer, then copy everything to the device (worker thread)."""
        staging, index = self._stager.stage(unit)
        start, end = unit.staged_range
        with torch.cuda.stream(self.stream):
            self._wait_for(after)
            timing = self._start_timing()
            for host, offset in unit.direct:
                buffer[offset : offset + host.numel()].copy_(host, non_blocking=True)
            buffer[start:end].copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._stager.done[index] = event
        self._end_timing(timing, "transfer", unit, unit.nbytes, self.stream)
        return event

    def wait(self, ticket: _Ticket) -> None:
        compute = self._compute()
        timing = self._start_timing(compute)
        compute.wait_event(ticket.resolve())
        self._end_timing(timing, "wait", None, 0, compute)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(self._compute())
        return event

    def release(self, buffer: torch.Tensor) -> None:
        """Count ``buffer`` out of the pool; the allocator reuses it once the streams recorded on it pass this point."""
        self.released_bytes += buffer.numel()

    def hand_over(self, buffer: torch.Tensor) -> None:
        """Count ``buffer`` out of the pool; autograd (or an output) holds its views, and ``record_stream`` keeps its free safe."""
        self.handed_over_bytes += buffer.numel()

    def synchronize(self) -> None:
        """Wait until every copy issued so far is done (before host blocks they read are freed)."""
        self.stream.synchronize()

    # -- telemetry: GPU-timed copies and waits, reported once they completed -----------------
    def _start_timing(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        if not events._ACTIVE:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream if stream is not None else self.stream)
        return start

    def _end_timing(
        self,
        start: torch.cuda.Event | None,
        kind: str,
        unit: StreamUnit | None,
        nbytes: int,
        stream: torch.cuda.Stream,
    ) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        name = unit.name if unit is not None else ""
        source = "+".join(sorted(unit.sources)) if unit is not None else ""
        with self._lock:
            self._timings.append((kind, name, source, nbytes, start, end))

    def report(self) -> None:
        """Emit the ``"transfer"`` / ``"wait"`` events whose CUDA events completed (forward thread)."""
        if not self._timings:
            return
        with self._lock:
            timings, self._timings = self._timings, []
        label = f"cuda:{self.device.index or 0}"
        for timing in timings:
            kind, name, source, nbytes, start, end = timing
            if not end.query():
                with self._lock:
                    self._timings.append(timing)
                continue
            now = time.perf_counter()
            seconds = start.elapsed_time(end) / 1000
            events.emit(events.HookEvent(kind, name, label, source or label, nbytes, seconds, now, True))


class Streamer:
    """Serves a model's offloading hooks on one device through a :class:`StreamSchedule` (see the module docstring).

    ``groups``: ``(unit name, hooks)`` in the order the units are first expected to run. ``engine``
    defaults to a :class:`CudaCopyEngine` for the hooks' device; tests give a recording engine.
    ``budget`` None: :func:`default_lookahead` of the device memory free once the units are packed
    (an engine without ``free_memory`` sets no limit there).
    """

    def __init__(
        self,
        device: torch.device,
        groups: list[tuple[str, list[AlignDevicesHook]]],
        engine: CopyEngine,
        budget: int | None,
        depth: int | None,
        pinner: HostPinner,
        owned: bool,
    ) -> None:
        self.device = device
        self.engine = engine
        self.pinner = pinner
        self.units = [pack_unit(name, hooks, pinner, owned) for name, hooks in groups]
        self.units = [unit for unit in self.units if unit.nbytes or unit.hooks]
        prepare = getattr(engine, "prepare", None)
        if prepare is not None:
            prepare(self.units, pinner)
        if budget is None:
            free = getattr(engine, "free_memory", None)
            largest = max((unit.nbytes for unit in self.units), default=0)
            budget = default_lookahead(free() if free is not None else 2**62, largest)
        self.schedule = StreamSchedule(engine, budget, depth)
        self._unit_of: dict[int, StreamUnit] = {}
        for unit in self.units:
            self.schedule.add(unit)
            for hook in unit.hooks:
                self._unit_of[id(hook)] = unit
        self._active: dict[int, tuple[StreamUnit, torch.Tensor]] = {}  # id(unit) -> (unit, its buffer)
        self._report = getattr(engine, "report", None)

    def serves(self, hook: AlignDevicesHook) -> bool:
        """Return whether ``hook`` loads through this streamer now (its execution device is the streamer's)."""
        return id(hook) in self._unit_of and hook._device == self.device

    def take(self, hook: AlignDevicesHook) -> tuple[list[torch.Tensor], bool]:
        """Return ``hook``'s tensors on the device (views of its unit's buffer) and whether the copy was ahead."""
        unit = self._unit_of[id(hook)]
        if self._report is not None:
            self._report()
        active = self._active.get(id(unit))
        hit = True
        if active is None:
            # Units none of whose modules is running any more are done: their buffers come back first.
            for other, _ in [a for a in self._active.values() if not a[0].installed]:
                self._end(other)
            hits = self.schedule.hits
            buffer = self.schedule.begin(unit)
            hit = self.schedule.hits > hits
            self._active[id(unit)] = (unit, buffer)
            unit.pending = {id(h) for h in unit.hooks}
        else:
            buffer = active[1]
        unit.installed.add(id(hook))
        typed: dict[torch.dtype, torch.Tensor] = {}
        values = []
        for offset, dtype, shape, stride in unit.views[id(hook)]:
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = buffer.view(dtype)
            values.append(base.as_strided(shape, stride, offset // base.element_size()))
        return values, hit

    def released(self, hook: AlignDevicesHook, output: object) -> None:
        """Note that ``hook``'s forward is over (its slots released); end its unit once all its hooks ran."""
        unit = self._unit_of.get(id(hook))
        if unit is None or id(hook) not in unit.installed:
            return
        unit.installed.discard(id(hook))
        unit.pending.discard(id(hook))
        active = self._active.get(id(unit))
        if active is not None and output is not None and not unit.escaped:
            unit.escaped = escapes(output, active[1])
        if not unit.pending and not unit.installed:
            self._end(unit)

    def _end(self, unit: StreamUnit) -> None:
        self._active.pop(id(unit), None)
        self.schedule.end(unit, unit.escaped)
        unit.escaped = False

    def remove(self, hook: AlignDevicesHook) -> None:
        """Stop serving ``hook`` (a unit left without hooks is dropped)."""
        unit = self._unit_of.pop(id(hook), None)
        if unit is None:
            return
        unit.hooks = [h for h in unit.hooks if h is not hook]
        unit.installed.discard(id(hook))
        unit.pending.discard(id(hook))
        if not unit.hooks:
            self._active.pop(id(unit), None)
            self.schedule.remove(unit)
            self.units = [u for u in self.units if u is not unit]

    def close(self) -> None:
        """Give every device buffer back; wait for the copies in flight before the host blocks can go."""
        self.schedule.close()
        self._active.clear()
        synchronize = getattr(self.engine, "synchronize", None)
        if synchronize is not None:
            synchronize()


def measure_pinned_bandwidth(
    device: int | str | torch.device | None = None, nbytes: int = 256 * 2**20, repeats: int = 5
) -> float:
    """Return the best host-to-device bandwidth (bytes/s) of ``repeats`` copies of ``nbytes`` from pinned memory."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    best = 0.0
    with torch.cuda.stream(stream):
        target.copy_(host, non_blocking=True)  # warm-up
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            target.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            best = max(best, nbytes / (start.elapsed_time(end) / 1000))
    return best
