"""What a launch shows while and after it runs: its output lines, progress bars and logged metrics.

``LaunchViews`` is the read side of ``LaunchHandle`` (the panels, the cell bars and the interactive ranks read it); the
handle's supervising thread fills ``_history`` and ``_events`` under ``_lock``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..utils._wire import unread_bytes
from .events import BarState, EventHub
from .output import OutputHistory, OutputLine

__all__ = ["LaunchViews", "OutputRecord"]


class OutputRecord:
    """The output lines a launch kept (bounded: ``output.HISTORY_*``), and their subscribers.

    Shared by ``LaunchHandle`` (one group) and ``RestartingHandle`` (every attempt's lines in one record).
    """

    _lock: threading.RLock
    _history: OutputHistory
    _subscribers: list[Callable[[OutputLine], None]]

    def subscribe(self, callback: Callable[[OutputLine], None]) -> Callable[[], None]:
        """Send ``callback`` every line so far, then each new one; return the unsubscribe function."""
        with self._lock:
            for line in self._history.snapshot():
                callback(line)
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def lines(self, rank: int | None = None) -> list[OutputLine]:
        """Return the output lines so far, of one ``rank`` or of all."""
        with self._lock:
            return self._history.snapshot(rank)

    @property
    def dropped_lines(self) -> int:
        """Return how many of the oldest output lines ``lines()`` no longer holds (the history is bounded)."""
        return self._history.dropped_lines

    @property
    def dropped_bytes(self) -> int:
        """Return the memory the dropped lines' text took; ``history_bytes``: what the kept lines take."""
        return self._history.dropped_bytes

    @property
    def history_bytes(self) -> int:
        """Return the memory the kept lines' text takes (at most ``output.HISTORY_BYTES`` plus the newest line)."""
        return self._history.bytes


class LaunchViews(OutputRecord):
    """Output lines, bars and metrics of a launch, for views and subscribers."""

    _events: EventHub
    _ranks: list[Any]  # the handle's per-rank books (ranks._Rank)
    _inbox: Any  # where a pushing backend's ranks report (inbox.RankInbox), else None

    # The restart facts of the run's read-only view, for a group that is one whole run (no ``max_restarts``):
    # ``restarts.RestartingHandle`` has the real ones.
    max_restarts = 0
    """How many times a failed group is restarted: none."""
    restarting = False
    """True while waiting to start the next try: never."""

    @property
    def attempts(self) -> list[object]:
        """Return the records of the tries that ended before this one (``restarts.Attempt``): none."""
        return []

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Return what ``accelerator.log`` sent through ``NotebookTracker``: one dict per call, ``step`` first.

        The values stay here after the launch ended; ``metrics_frame()`` gives them as a DataFrame.
        """
        return self._events.metrics()

    def metrics_frame(self) -> Any:
        """Return ``metrics`` as a pandas DataFrame indexed by step (needs pandas)."""
        try:
            import pandas
        except ImportError as exc:
            raise ImportError(
                "metrics_frame() needs pandas (pip install pandas); handle.metrics is the same data as a list"
            ) from exc
        return pandas.DataFrame(self.metrics, columns=None).set_index("step", drop=True)

    def bars(self, rank: int | None = None, live_only: bool = False) -> list[BarState]:
        """Return the progress bars' last states (of ``rank``); ``live_only``: open bars of the live ranks."""
        return self._events.bars(rank, live_only)

    @property
    def live_bar_ranks(self) -> set[int] | None:
        """Return the ranks whose bars a view shows live (None: all)."""
        return self._events.live_ranks

    def subscribe_events(self, callback: Callable[[str, int, Any], None]) -> Callable[[], None]:
        """Call ``callback(kind, rank, state)`` for each bar/metrics/usage event; return the unsubscribe function.

        Called on the supervising thread: the callback must return quickly.
        """
        return self._events.subscribe(callback)

    def output_drained(self, rank: int) -> bool:
        """Return True when every byte ``rank`` wrote to its pipes (or inbox) so far was handled (lines at the sinks).

        That is its stdout and stderr, and its events (a closed progress bar's last line); a last
        line without its newline stays pending. The interactive ranks print a command's last lines
        before its result with it.
        """
        return not self.output_pending([rank])

    def output_pending(self, ranks: Iterable[int]) -> list[int]:
        """Return those of ``ranks`` whose output is not all handled yet (``output_drained``'s test, one lock for all)."""
        with self._lock:
            first = self._ranks[0].rank
            books = [self._ranks[rank - first] for rank in ranks]
            pushed = self._inbox.pending_of([r.proc for r in books]) if self._inbox is not None else set()
            return [r.rank for r in books if r.proc in pushed or any(unread_bytes(fd) for fd in r.fds)]
