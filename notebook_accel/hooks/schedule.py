"""The offload schedule as plain logic: which copy is issued when, what the compute waits for, what may be freed.

Nothing here touches torch. The prefetcher drives two objects:

- :class:`ExecutionOrder` learns the order in which offloaded units run (a unit is one hook on the
  CPU, one group of hooks sharing a device-map block when streaming to a GPU): the unit that starts
  after unit A is A's successor; registration order is the first guess, so a model whose forward
  does not follow its module order is served correctly from its second forward on, and a wrong
  guess only costs a discarded load.
- :class:`StreamSchedule` keeps the copies of the next units in flight within a byte budget (the
  lookahead) and a depth, on a :class:`CopyEngine`: the CUDA one in :mod:`.streaming` (side stream,
  events, pooled device buffers), or a recording fake in the tests, so that CI checks the order of
  copies, waits and frees without a GPU.

A unit's life in :class:`StreamSchedule`:

1. *issued*: a device buffer is taken (a free one that fits, else a new one while the budget allows)
   and the engine copies the unit's weights into it, after the buffer's previous reader is done;
2. *active* (:meth:`StreamSchedule.begin`): the compute waits for that copy only, then runs;
3. *done* (:meth:`StreamSchedule.end`): the engine marks the point after the unit's computation;
   the buffer goes back to the free list and is reused for a later copy once that point is
   reached. A buffer whose tensors escaped (autograd saved them for a backward pass, or an output
   is a view of a weight) is handed over instead: it leaves the pool and the budget, and the
   allocator frees it when its last user lets go.

The budget bounds the pool: every buffer the schedule holds (active, in flight, free) counts, so
the device memory used for offloaded weights stays within the budget, plus the escaped buffers. The
one exception: a unit that starts when the active units leave no room for it still gets its
buffer (a model always runs), with a budget too small for the units that run at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["CopyEngine", "ExecutionOrder", "StreamSchedule", "Unit"]


class ExecutionOrder:
    """The order offloaded units run in, learnt as they run (see the module docstring).

    Units are compared as dictionary keys are (hooks and stream units: by identity).

    ``wrap``: guess that the first unit follows the last one (the next forward), so that its copy
    is issued as the current forward ends.
    """

    def __init__(self, wrap: bool = False) -> None:
        self.wrap = wrap
        self._units: list[Hashable] = []
        self._next: dict[Hashable, Hashable] = {}
        self._last: Hashable | None = None

    def add(self, unit: Hashable) -> None:
        """Append ``unit``; until they run, units are guessed to run in the order they were added."""
        if self._units:
            self._next[self._units[-1]] = unit
        self._units.append(unit)
        if self.wrap:
            self._next[unit] = self._units[0]

    def remove(self, unit: Hashable) -> None:
        """Forget ``unit`` (its predecessor then has no known successor)."""
        self._units = [u for u in self._units if u != unit]
        self._next.pop(unit, None)
        for key in [k for k, successor in self._next.items() if successor == unit]:
            del self._next[key]
        if self._last == unit:
            self._last = None

    def observe(self, unit: Hashable) -> None:
        """Note that ``unit`` starts now: it is the successor of the unit that started before it."""
        last = self._last
        if last is not None and last != unit:
            self._next[last] = unit
        self._last = unit

    def ahead(self, unit: Hashable) -> Iterator[Hashable]:
        """Yield the units expected after ``unit``, nearest first, each once, never ``unit`` itself."""
        seen = {unit}
        current = self._next.get(unit)
        while current is not None and current not in seen:
            seen.add(current)
            yield current
            current = self._next.get(current)

    def __contains__(self, unit: object) -> bool:
        return unit in self._units

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._units))

    def __len__(self) -> int:
        return len(self._units)


class Unit(Protocol):
    """What the schedule needs of a unit: its size on the device (hashable by identity)."""

    nbytes: int


class CopyEngine(Protocol):
    """The device side of a :class:`StreamSchedule` (CUDA: :class:`~notebook_accel.hooks.streaming.CudaCopyEngine`)."""

    def allocate(self, nbytes: int) -> object:
        """Return a new device buffer of ``nbytes`` (safe to write on the copy stream at once)."""

    def copy(self, unit: Unit, buffer: object, after: object | None) -> object:
        """Copy ``unit``'s weights into ``buffer`` once ``after`` (a mark, a ticket or None) is reached; return a ticket."""

    def wait(self, ticket: object) -> None:
        """Make the computation wait for the copy ``ticket`` (and only for it)."""

    def mark(self) -> object:
        """Return a mark of the computation issued so far (the point after which a buffer may be rewritten)."""

    def release(self, buffer: object) -> None:
        """Give ``buffer`` back to the device allocator (no longer part of the pool)."""

    def hand_over(self, buffer: object) -> None:
        """Forget ``buffer`` whose tensors are still in use elsewhere (the allocator frees it after them)."""


@dataclass
class _Held:
    """A buffer of the pool and what must happen before it may be written again."""

    buffer: Any
    nbytes: int
    after: Any = None


@dataclass
class _InFlight:
    held: _Held
    ticket: Any


@dataclass
class StreamSchedule:
    """Copies of the next units in flight within ``budget`` bytes and ``depth`` units (see the module docstring).

    ``depth`` None: as many units ahead as the budget allows. ``begin`` / ``end`` are called by the
    prefetcher as units start and finish; every device action goes through ``engine``.
    """

    engine: CopyEngine
    budget: int
    depth: int | None = None
    order: ExecutionOrder = field(default_factory=lambda: ExecutionOrder(wrap=True))
    hits: int = 0
    """Units whose copy was already issued when they started."""
    misses: int = 0
    """Units copied only when they started (the computation waited for the whole copy)."""

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"StreamSchedule budget must be a number of bytes >= 0, got {self.budget!r}")
        if self.depth is not None and (not isinstance(self.depth, int) or self.depth < 1):
            raise ValueError(f"StreamSchedule depth must be None or an int >= 1, got {self.depth!r}")
        self._in_flight: dict[Any, _InFlight] = {}
        self._active: dict[Any, _Held] = {}
        self._free: list[_Held] = []
        self.held_bytes = 0
        """Bytes of every buffer in the pool (active, in flight and free)."""
        self.peak_bytes = 0

    # -- registration ------------------------------------------------------------------------
    def add(self, unit: Unit) -> None:
        """Serve ``unit`` (guessed to run after the units added before it)."""
        self.order.add(unit)

    def remove(self, unit: Unit) -> None:
        """Stop serving ``unit``; its buffer (in flight or active) goes back to the free list."""
        self.order.remove(unit)
        flight = self._in_flight.pop(unit, None)
        if flight is not None:
            self._free_after(flight.held, flight.ticket)
        held = self._active.pop(unit, None)
        if held is not None:
            self._free_after(held, self.engine.mark())

    @property
    def in_flight(self) -> list[Any]:
        """Return the units whose copy is issued and which have not started, in issue order."""
        return list(self._in_flight)

    @property
    def active(self) -> list[Any]:
        """Return the units started and not ended."""
        return list(self._active)

    # -- the computation's side ----------------------------------------------------------------
    def begin(self, unit: Unit) -> Any:
        """Return the buffer holding ``unit``'s weights, the computation waiting for their copy; then copy ahead."""
        held = self._active.get(unit)
        if held is not None:  # started again before it ended (a module called twice in a row)
            return held.buffer
        self.order.observe(unit)
        flight = self._in_flight.pop(unit, None)
        if flight is None:
            self.misses += 1
            self._drop_unexpected(self._wanted(unit))  # the guesses were wrong: their room first
            held = self._take(unit.nbytes, must=True)
            flight = _InFlight(held, self.engine.copy(unit, held.buffer, held.after))
        else:
            self.hits += 1
        self.engine.wait(flight.ticket)
        self._active[unit] = flight.held
        self._fill(unit)
        return flight.held.buffer

    def end(self, unit: Unit, escaped: bool = False) -> None:
        """Note that ``unit``'s computation is issued; its buffer is reused after it (or handed over if ``escaped``)."""
        held = self._active.pop(unit, None)
        if held is None:
            return
        if escaped:
            self.held_bytes -= held.nbytes
            self.engine.hand_over(held.buffer)
        else:
            self._free_after(held, self.engine.mark())
        self._fill(unit)

    def close(self) -> None:
        """Give every buffer back (nothing is in flight or active afterwards)."""
        for flight in self._in_flight.values():
            self._free_after(flight.held, flight.ticket)
        for held in self._active.values():
            self._free_after(held, self.engine.mark())
        self._in_flight.clear()
        self._active.clear()
        for held in self._free:
            self.engine.release(held.buffer)
        self.held_bytes -= sum(held.nbytes for held in self._free)
        self._free.clear()

    # -- the pool ------------------------------------------------------------------------------
    def _wanted(self, current: Unit) -> list[Any]:
        """Return the units expected after ``current``, nearest first, at most ``depth`` of them."""
        wanted = []
        for count, unit in enumerate(self.order.ahead(current)):
            if self.depth is not None and count >= self.depth:
                break
            wanted.append(unit)
        return wanted

    def _drop_unexpected(self, wanted: list[Any]) -> None:
        """Put the buffers of copies nobody expects soon (a wrong guess) back on the free list."""
        for unit in [u for u in self._in_flight if u not in wanted]:
            flight = self._in_flight.pop(unit)
            self._free_after(flight.held, flight.ticket)

    def _fill(self, current: Unit) -> None:
        """Issue the copies of the units expected after ``current`` while the budget and depth allow."""
        wanted = self._wanted(current)
        self._drop_unexpected(wanted)
        for unit in wanted:
            if unit in self._in_flight or unit in self._active:
                continue
            held = self._take(unit.nbytes, must=False)
            if held is None:
                break  # the budget is full: the next units wait for a buffer to come back
            self._in_flight[unit] = _InFlight(held, self.engine.copy(unit, held.buffer, held.after))

    def _take(self, nbytes: int, must: bool) -> _Held | None:
        """Return a buffer of at least ``nbytes``: the smallest free one that fits, else a new one within the budget.

        Free buffers too small are released to make room. With ``must`` (a unit starting now) a new
        buffer is allocated even past the budget.
        """
        fitting = [held for held in self._free if held.nbytes >= nbytes]
        if fitting:
            held = min(fitting, key=lambda h: h.nbytes)
            self._free.remove(held)
            return held
        while self._free and self.held_bytes + nbytes > self.budget:
            smallest = min(self._free, key=lambda h: h.nbytes)
            self._free.remove(smallest)
            self.held_bytes -= smallest.nbytes
            self.engine.release(smallest.buffer)
        if self.held_bytes + nbytes > self.budget and not must:
            return None
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return _Held(self.engine.allocate(nbytes), nbytes)

    def _free_after(self, held: _Held, after: object | None) -> None:
        """Put ``held`` on the free list, reusable after ``after``; past the budget (a unit bigger than the room left), release it."""
        if self.held_bytes > self.budget:
            self.held_bytes -= held.nbytes
            self.engine.release(held.buffer)
            return
        held.after = after
        self._free.append(held)
