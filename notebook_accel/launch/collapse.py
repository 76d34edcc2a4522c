"""Lines that many ranks print alike, shown once with their rank set: a cell stays readable at a hundred ranks.

``Collapser`` is the rule, with no clock or thread of its own (the caller says what time it is);
``CollapsingPrinter`` is the launch's printing sink built on it, a ``PrintSink`` whose held lines go
out on a timer thread. The interactive ranks' cell sink (``interactive.cell_output``) drives a
``Collapser`` from the thread of the running command instead. Only what is printed in the cell is
collapsed: the handle's history (``lines()``, the panel) and the ``log_dir`` files get every line.

The rule:

- Only **exactly equal** lines collapse (same stream, same text, same attempt); one printed by ranks
  0 to 15 shows once as ``[ranks 0-15] text`` (``[n1-n8 ranks 0-15] text`` across nodes), one printed
  by ranks 0 and 2 as ``[ranks 0,2] text``, one printed by one rank as ``[rank 3] text``. No text is
  dropped or rewritten, and no line is counted into another.
- A line is **held** while other ranks may still print it: it goes out as soon as every expected rank
  (every rank of the launch; a command's target ranks) printed it, else ``window`` seconds after the
  first rank did (0.25 s by default), else at the end of the launch or command. Lines of one rank keep
  their order: a line behind a held line of its rank waits for it. So every line goes out at most
  ``window`` seconds after it was read.
- A line **nobody is likely to repeat goes out at once**. Lines are sorted by shape, their text with
  every run of digits masked (``step # loss #.#``). Once the first held line of a shape came back, a
  shape only one rank has printed is that rank's own (``if rank == 0: print(...)``), and a shape whose
  last three held lines each came back from one rank differs per rank (``print(rank, loss)``): the
  lines of both go out at once. Until then a shape's lines are held; another rank printing a rank's
  own shape, or repeating the line a shape last sent at once (within the window), makes it held again.
  The last 4,096 shapes are remembered (an interactive group's carry from command to command).
- A rank **running behind** (it printed lines of its own, still held, before a line the others
  printed earlier) lets those lines go at once, so that it joins the shared one.
- Collapsed lines go out in the order their first copy arrived. Work per line is a few dict
  operations (and, for a line that joins no held group, one regular-expression pass over its text).
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .output import OutputLine, PrintSink

__all__ = ["DEFAULT_WINDOW", "CollapsingPrinter", "Collapser", "collapse_window"]

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 0.25
"""Seconds a line is held for the other ranks by default (``collapse_output=True``).

Ranks that print the same line after a collective print it within milliseconds of each other, and a
complete set goes out at once; a quarter of a second covers ranks a little apart without a visible
delay (Ray waits 5 s)."""
SOLO_AFTER = 3
"""Held lines of a shape that came back from one rank each, in a row, before the shape goes out at once."""
LONGEST = 10_000
"""Characters above which a line is never held (printed per rank): a long dump is rarely repeated alike."""
_SCAN = 8  # open groups of one text a line may try to join (a rank repeating a line starts another)
_SHAPES_KEPT = 4096  # shapes remembered (the oldest forgotten first)
_DIGITS = re.compile(r"\d+")

Emit = Callable[[OutputLine, tuple[int, ...]], None]


def collapse_window(value: Any) -> float | None:
    """Return the hold window in seconds that ``collapse_output=value`` asks for (None: collapsing off).

    Raises TypeError / ValueError naming ``value`` when it is not True, False or a positive number.
    """
    if value is True or value is False:
        return DEFAULT_WINDOW if value else None
    if not isinstance(value, (int, float)):
        raise TypeError(
            f"collapse_output={value!r} must be True (identical lines from several ranks shown once, each "
            f"held up to {DEFAULT_WINDOW:g} s for the others), False (every rank's line printed as it comes) "
            "or a number of seconds to hold a line for the other ranks"
        )
    if not 0 < value < math.inf:
        raise ValueError(
            f"collapse_output={value!r} must be a positive, finite number of seconds (how long a line waits "
            f"for the other ranks; True: {DEFAULT_WINDOW:g} s), or False to print every rank's line as it comes"
        )
    return float(value)


class _Entry:
    """A line waiting to go out: held for other ranks (a group), or one rank's line behind a held one."""

    __slots__ = ("seq", "line", "key", "shape", "ranks", "counted", "blocked", "ready", "deadline")

    def __init__(self, seq: int, line: OutputLine, key: tuple, shape: tuple | None, deadline: float) -> None:
        self.seq = seq  # order of arrival; a rank's queue holds increasing seqs (but for its own lines)
        self.line, self.key, self.shape = line, key, shape  # shape None: not held, one rank's line
        self.ranks: set[int] = set()
        self.counted = 0  # ranks of the expected set among ``ranks``
        self.blocked = 0  # ranks whose queue has an earlier entry before this one
        self.ready = shape is None  # may go out once no rank of it is blocked
        self.deadline = deadline


class _Shape:
    """What was learnt of one shape: who printed it, and whether its held lines came back alone."""

    __slots__ = ("owner", "known", "solo", "sent")

    def __init__(self, rank: int) -> None:
        self.owner: int | None = rank  # the one rank that printed the shape so far (None: several did)
        self.known = False  # a held line of it went out: what it came back with is known
        self.solo = 0  # held lines of it in a row that came back from one rank only
        self.sent: tuple[tuple, int, float] | None = None  # (key, rank, when) of its last line sent at once


class Collapser:
    """Hold, group and release lines by the module's rule; ``emit(line, ranks)`` prints one.

    ``ranks``: the expected ranks (a held line is complete once all of them printed it). Not thread
    safe: one thread feeds it, or the caller holds a lock. ``now`` is any clock's reading, the same
    clock for every call (``time.monotonic()``).
    """

    def __init__(self, ranks: Iterable[int], window: float, emit: Emit) -> None:
        self.expected = ranks
        self.window = window
        self._emit = emit
        self._seq = 0
        self._queues: dict[int, collections.deque[_Entry]] = {}
        self._feeding: OutputLine | None = None  # the line being fed, until it is queued or printed
        # (stream, attempt, text) -> the groups of that line still open to more ranks, oldest first
        self._open: dict[tuple, collections.deque[_Entry]] = {}
        self._timeline: collections.deque[_Entry] = collections.deque()  # held groups by deadline
        # Ordered: dropping the oldest shape is O(1) (a plain dict's first key is found by scanning).
        self._shapes: collections.OrderedDict[tuple[str, str], _Shape] = collections.OrderedDict()

    @property
    def expected(self) -> frozenset[int]:
        """Return the ranks a held line waits for (set it between commands, while nothing is held)."""
        return self._expected

    @expected.setter
    def expected(self, ranks: Iterable[int]) -> None:
        self._expected = frozenset(ranks)
        self._complete = len(self._expected)

    @property
    def next_deadline(self) -> float | None:
        """Return when the oldest held group must go out (None: nothing held)."""
        timeline = self._timeline
        while timeline and timeline[0].ready:
            timeline.popleft()
        return timeline[0].deadline if timeline else None

    @property
    def pending(self) -> int:
        """Return the number of lines (of all ranks) not printed yet."""
        return sum(len(queue) for queue in self._queues.values())

    def feed(self, line: OutputLine, now: float) -> None:
        """Take one rank's line read at ``now``: print it, hold it, or add its rank to a held group."""
        try:
            self._feed(line, now)
        except BaseException:  # ^C between two steps of it, or a failing sink: print what waits, then raise
            self._print_stranded()
            raise

    def expire(self, now: float) -> None:
        """Print the groups held since ``window`` or longer before ``now`` (and what waited behind them)."""
        try:
            self._expire(now)
        except BaseException:
            self._print_stranded()
            raise

    def flush(self) -> None:
        """Print everything held now, in order (the end of a launch or of a command)."""
        try:
            while self._timeline:
                group = self._timeline.popleft()
                if not group.ready:
                    self._make_ready(group)
        except BaseException:
            self._print_stranded()
            raise

    def _feed(self, line: OutputLine, now: float) -> None:
        timeline = self._timeline
        if timeline and (timeline[0].ready or timeline[0].deadline <= now):
            self._expire(now)
        rank = line.rank
        queue = self._queues.get(rank)
        if queue is None:
            queue = self._queues[rank] = collections.deque()
        self._feeding = line  # until it is queued or printed
        key = (line.stream, line.attempt, line.text)
        group = self._joinable(key, rank, queue)
        if group is not None:
            self._add(group, rank, queue)
            if group.counted == self._complete:
                self._make_ready(group)
            return
        shape = (line.stream, _DIGITS.sub("#", line.text)) if len(line.text) <= LONGEST else None
        if shape is None or not self._hold(key, shape, rank, now):
            if not queue:
                self._emit(line, (rank,))
                self._feeding = None
                return
            self._add(self._entry(line, key, None, now), rank, queue)
            return
        group = self._entry(line, key, shape, now + self.window)
        self._open.setdefault(key, collections.deque()).append(group)
        self._timeline.append(group)
        self._add(group, rank, queue)
        if group.counted == self._complete:
            self._make_ready(group)

    def _expire(self, now: float) -> None:
        timeline = self._timeline
        while timeline and (timeline[0].ready or timeline[0].deadline <= now):
            group = timeline.popleft()
            if not group.ready:
                self._make_ready(group)

    def _print_stranded(self) -> None:
        """Print every waiting line, each rank's in its order, uncollapsed, and start afresh.

        After a step was cut short the books may not add up, so nothing is released by them: a
        line printed just before the cut may show twice, none is lost.
        """
        waiting = [(rank, entry.line) for rank, queue in self._queues.items() for entry in queue]
        feeding, self._feeding = self._feeding, None
        if feeding is not None:
            waiting.append((feeding.rank, feeding))
        self._queues.clear()
        self._open.clear()
        self._timeline.clear()
        if waiting:
            logger.warning(
                "printing %d output line(s) uncollapsed: collapsing them was interrupted", len(waiting)
            )
        for rank, line in waiting:
            self._emit(line, (rank,))

    # ------------------------------------------------------------------ groups

    def _entry(self, line: OutputLine, key: tuple, shape: tuple | None, deadline: float) -> _Entry:
        self._seq += 1
        return _Entry(self._seq, line, key, shape, deadline)

    def _joinable(self, key: tuple, rank: int, queue: collections.deque[_Entry]) -> _Entry | None:
        """Return the oldest held group of ``key`` that ``rank`` may join without reordering its lines."""
        groups = self._open.get(key)
        if groups is None:
            return None
        scanned = 0
        for group in groups:
            scanned += 1
            if scanned > _SCAN:
                break
            if group.ready or rank in group.ranks:
                continue
            if not queue or queue[-1].seq < group.seq or self._close_own_lines_after(group.seq, rank, queue):
                return group
        return None

    def _close_own_lines_after(self, seq: int, rank: int, queue: collections.deque[_Entry]) -> bool:
        """Return True after closing ``rank``'s held lines newer than group ``seq``, if each is its alone.

        The rank printed them before a line the others printed earlier: it runs behind, and those
        lines are its own (``rank 1 loaded 100 rows``: another rank printing one alike would have
        printed it before the shared line too). Closed, they go out ahead of the shared line, and the
        rank joins it in order. A newer line some other rank shares keeps the rank out (False).
        """
        later = []
        for entry in reversed(queue):
            if entry.seq < seq:
                break
            if len(entry.ranks) > 1 or len(later) == _SCAN:
                return False
            later.append(entry)
        for entry in reversed(later):
            if not entry.ready:
                self._make_ready(entry)
        return True

    def _add(self, entry: _Entry, rank: int, queue: collections.deque[_Entry]) -> None:
        entry.ranks.add(rank)
        if rank in self._expected:
            entry.counted += 1
        if queue:
            entry.blocked += 1
        queue.append(entry)
        self._feeding = None

    def _make_ready(self, group: _Entry) -> None:
        """Close ``group`` to new ranks; print it now unless a rank of it has an earlier line waiting."""
        group.ready = True
        groups = self._open.get(group.key)
        if groups is not None:
            while groups and groups[0].ready:
                groups.popleft()
            if not groups:
                del self._open[group.key]
        if group.blocked == 0:
            self._release(group)

    def _release(self, first: _Entry) -> None:
        """Print ``first``, then each entry it unblocks that is ready, oldest first."""
        heap = [(first.seq, first)]
        while heap:
            _, entry = heapq.heappop(heap)
            ranks = tuple(sorted(entry.ranks))
            self._emit(entry.line, ranks)
            if entry.shape is not None:
                self._learn(entry.shape, ranks)
            for rank in ranks:
                queue = self._queues[rank]
                queue.popleft()
                if queue:
                    head = queue[0]
                    head.blocked -= 1
                    if head.blocked == 0 and head.ready:
                        heapq.heappush(heap, (head.seq, head))

    # ------------------------------------------------------------------ learning

    def _hold(self, key: tuple, shape: tuple[str, str], rank: int, now: float) -> bool:
        """Return whether a line of ``key`` (no group to join) should wait for other ranks.

        A line that goes out at once is remembered as its shape's last: the same line from another
        rank within the window shows that the shape's lines coincide after all.
        """
        stats = self._shapes.get(shape)
        if stats is None:
            if len(self._shapes) >= _SHAPES_KEPT:
                self._shapes.popitem(last=False)
            self._shapes[shape] = _Shape(rank)
            return True
        if rank != stats.owner:
            stats.owner = None
        sent = stats.sent
        if sent is not None and sent[0] == key and sent[1] != rank and now - sent[2] <= self.window:
            stats.solo = 0
            return True
        if stats.known and (stats.owner is not None or stats.solo >= SOLO_AFTER):
            stats.sent = (key, rank, now)
            return False
        return True  # shared, or its first held line has not come back yet

    def _learn(self, shape: tuple[str, str], ranks: tuple[int, ...]) -> None:
        stats = self._shapes.get(shape)
        if stats is not None:
            stats.known = True
            if len(ranks) > 1:
                stats.owner, stats.solo = None, 0
            else:
                stats.solo += 1
                if stats.owner != ranks[0]:
                    stats.owner = None


class CollapsingPrinter:
    """A ``PrintSink`` whose lines go through a ``Collapser``; held lines go out on a timer thread.

    The launch's printing sink (``collapse_output``). ``announce`` prints what is held first (a
    message of the launcher comes after the lines before it); ``close`` prints the rest and ends the
    thread, at the end of the launch. Every write happens under one lock, so lines never interleave.
    """

    def __init__(
        self,
        printer: PrintSink,
        ranks: Iterable[int],
        window: float = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.printer = printer
        self._collapser = Collapser(ranks, window, printer.write)
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False

    def __call__(self, line: OutputLine) -> None:
        with self._cond:
            if self._closed:
                self.printer.write(line)
                return
            idle = self._collapser.next_deadline is None
            self._collapser.feed(line, self._clock())
            if idle and self._collapser.next_deadline is not None:
                self._wake()

    def announce(self, text: str) -> None:
        """Print what is held, then a message of the launcher itself."""
        with self._cond:
            self._collapser.flush()
            self.printer.announce(text)

    def flush(self) -> None:
        """Print everything held now."""
        with self._cond:
            self._collapser.flush()

    def close(self) -> None:
        """Print everything held and end the timer thread (idempotent); later lines print at once."""
        with self._cond:
            self._collapser.flush()
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="notebook_accel-collapse", daemon=True)
            self._thread.start()
        else:
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                deadline = self._collapser.next_deadline
                now = self._clock()
                if deadline is None or deadline > now:
                    self._cond.wait(None if deadline is None else deadline - now)
                    continue
                try:
                    self._collapser.expire(now)
                except Exception:  # a sink's error must not end the timer: later lines would wait for the end
                    logger.exception("printing held output lines failed")
