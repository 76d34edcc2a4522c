"""Launcher side of the per-rank message channel: frames read from a worker's result pipe, and what they say.

A worker writes length-prefixed pickles on its result pipe (see ``utils._worker_channel``): events
while it runs, its result last. :class:`FrameDecoder` cuts the bytes back into messages;
:class:`EventHub` keeps what the events describe for the handle and the panels: the state of every
progress bar (``"bar"``), the logged metrics (``"metrics"``, from ``NotebookTracker``) and what a
worker measures about itself (``"usage"``: device memory, its final CPU time and peak memory).
Subscribers are called on the supervising thread, so they must be quick (a panel only schedules a
redraw).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..utils._worker_channel import FRAME_HEADER
from .output import OutputLine

__all__ = ["BarState", "EventHub", "FrameDecoder"]

logger = logging.getLogger(__name__)

_KEPT_CLOSED_BARS = 100  # per rank: a loop opening a bar per batch must not grow the launcher's memory


def unsubscriber(lock: AbstractContextManager, subscribers: list, callback: Callable) -> Callable[[], None]:
    """Return the function that takes ``callback`` out of ``subscribers`` under ``lock`` (again: nothing happens)."""

    def unsubscribe() -> None:
        with lock:
            if callback in subscribers:
                subscribers.remove(callback)

    return unsubscribe


class FrameDecoder:
    """Cut a byte stream into the messages it frames (a partial frame waits for the next bytes)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        """Return every message completed by ``data``; a body that cannot be unpickled raises."""
        size = FRAME_HEADER.size
        if not self._buffer and len(data) >= size:  # the common case: ``data`` is exactly one frame
            (length,) = FRAME_HEADER.unpack_from(data)
            if len(data) == size + length:
                with memoryview(data) as view:
                    return [pickle.loads(view[size:])]
        self._buffer += data
        messages = []
        while len(self._buffer) >= size:
            (length,) = FRAME_HEADER.unpack_from(self._buffer)
            if len(self._buffer) < size + length:
                break
            body = bytes(self._buffer[size : size + length])
            del self._buffer[: size + length]
            messages.append(pickle.loads(body))
        return messages

    @property
    def pending(self) -> int:
        """Return how many bytes of an unfinished frame are buffered (non-zero at EOF: truncated)."""
        return len(self._buffer)


@dataclass
class BarState:
    """The last known state of one progress bar of one rank."""

    rank: int
    id: int
    """Per-rank bar number, in order of first display."""
    desc: str
    n: float
    total: float | None
    elapsed: float
    """Seconds since the bar started."""
    rate: float | None
    """Units per second (tqdm's smoothed rate; the average once closed)."""
    unit: str
    text: str
    """The line tqdm itself would draw (``format_meter``)."""
    stream: str
    closed: bool = False
    leave: bool = True


class EventHub:
    """What the events of a launch say so far: bars, metrics and the workers' own usage figures."""

    def __init__(self, live_ranks: set[int] | None = None) -> None:
        self.live_ranks = live_ranks
        """Ranks whose bars a view shows live (None: every rank)."""
        self._lock = threading.Lock()
        self._bars: dict[tuple[int, int], BarState] = {}
        self._metrics: list[dict[str, Any]] = []
        self._usage: dict[int, dict[str, Any]] = {}
        self._subscribers: list[Callable[[str, int, Any], None]] = []

    # -- reading ------------------------------------------------------------------------------
    def bars(self, rank: int | None = None, live_only: bool = False) -> list[BarState]:
        """Return the bars (of ``rank``, or all), open ones of the live ranks only with ``live_only``."""
        with self._lock:
            bars = list(self._bars.values())
        return [
            b
            for b in bars
            if (rank is None or b.rank == rank)
            and not (
                live_only and (b.closed or (self.live_ranks is not None and b.rank not in self.live_ranks))
            )
        ]

    def metrics(self) -> list[dict[str, Any]]:
        """Return a copy of the logged metrics, one dict per ``log`` call (``step`` plus the values)."""
        with self._lock:
            return [dict(m) for m in self._metrics]

    def usage(self, rank: int) -> dict[str, Any]:
        """Return what rank ``rank`` reported about itself (device memory, final CPU%, peak RSS)."""
        with self._lock:
            return dict(self._usage.get(rank, {}))

    def subscribe(self, callback: Callable[[str, int, Any], None]) -> Callable[[], None]:
        """Call ``callback(kind, rank, state)`` on every event; return the unsubscribe function."""
        with self._lock:
            self._subscribers.append(callback)
        return unsubscriber(self._lock, self._subscribers, callback)

    # -- receiving ----------------------------------------------------------------------------
    def dispatch(self, rank: int, kind: str, payload: dict[str, Any]) -> list[OutputLine]:
        """Record one event of ``rank``; return the output lines it ends (a closed bar's last state)."""
        lines: list[OutputLine] = []
        with self._lock:
            if kind == "bar":
                state = BarState(rank, **{k: payload[k] for k in _BAR_FIELDS})
                self._bars[(rank, state.id)] = state
                if state.closed:
                    self._prune_closed(rank)
                if state.closed and state.leave:
                    lines.append(OutputLine(rank, state.stream, state.text, time.time()))
                item: Any = state
            elif kind == "metrics":
                item = dict(payload)
                self._metrics.append(item)
            elif kind == "usage":
                self._usage.setdefault(rank, {}).update(payload)
                item = dict(payload)
            else:  # a newer worker's event this launcher does not know: not worth failing the run
                logger.debug("ignored event %r from rank %d", kind, rank)
                return lines
            subscribers = list(self._subscribers)
        self._notify(subscribers, kind, rank, item)
        return lines

    def notify(self, kind: str, rank: int, item: Any) -> None:
        """Call the subscribers with an event of the launcher itself (``"hang"``: the report text)."""
        with self._lock:
            subscribers = list(self._subscribers)
        self._notify(subscribers, kind, rank, item)

    def end_rank(self, rank: int) -> list[OutputLine]:
        """Close the bars ``rank`` left open (it ended or died); return their last states as lines."""
        lines = []
        with self._lock:
            for state in self._bars.values():
                if state.rank == rank and not state.closed:
                    state.closed = True
                    lines.append(OutputLine(rank, state.stream, state.text, time.time()))
            subscribers = list(self._subscribers)
        if lines:
            self._notify(subscribers, "bar", rank, None)
        return lines

    def _prune_closed(self, rank: int) -> None:
        closed = [key for key, b in self._bars.items() if b.rank == rank and b.closed]
        for key in closed[: max(0, len(closed) - _KEPT_CLOSED_BARS)]:  # oldest first (insertion order)
            del self._bars[key]

    @staticmethod
    def _notify(subscribers: list, kind: str, rank: int, item: Any) -> None:
        for callback in subscribers:
            try:
                callback(kind, rank, item)
            except Exception:
                logger.exception("event subscriber %r failed on a %r event of rank %d", callback, kind, rank)


_BAR_FIELDS = ("id", "desc", "n", "total", "elapsed", "rate", "unit", "text", "stream", "closed", "leave")
