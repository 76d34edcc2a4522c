"""A test-only run: the run's read-only view (``RunView``) as the launch panel reads it, set by the test's hand.

Real ``RankStatus``/``OutputLine``/``BarState``/``Attempt`` values, with what a CPU-only machine on one
host cannot produce: ranks on several nodes, CUDA figures, restarts, dropped lines, a hang report, and
an end whenever the test says. Every member of the view is here (the panel reads no other, and
checks them all when it is built).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from notebook_accel.launch.errors import LaunchError
from notebook_accel.launch.events import BarState
from notebook_accel.launch.interfaces import RunView
from notebook_accel.launch.output import OutputLine
from notebook_accel.launch.ranks import RankStatus


def rank_status(rank: int, node: str | None = None, state: str = "running", **figures: object) -> RankStatus:
    """Return a started rank's status (pid ``1000 + rank``) with ``figures`` (cpu_percent, rss, cuda_*...)."""
    return RankStatus(rank=rank, pid=1000 + rank, state=state, started_at=time.time(), node=node, **figures)


class FakeRun(RunView):
    """A run of ``statuses`` with ``bars``; ``emit`` sends a line, ``finish`` ends it."""

    live_bar_ranks: set[int] | None = None

    def __init__(self, statuses: list[RankStatus], bars: list[BarState] | None = None) -> None:
        self.statuses = statuses
        self.bar_states = list(bars or [])
        self.num_processes = len(statuses)
        self.done, self.error, self.hang_report, self.dropped_lines = False, None, None, 0
        self.metrics: list[dict] = []
        self.attempt, self.max_restarts, self.restarting, self.attempts = 1, 0, False, []
        self.line_subscribers: list[Callable[[OutputLine], None]] = []
        self.event_subscribers: list[Callable[[str, int, object], None]] = []
        self.done_callbacks: list[Callable[[object], None]] = []
        self.stopped = 0

    def status(self) -> list[RankStatus]:
        return [dataclasses.replace(s) for s in self.statuses]

    def lines(self, rank: int | None = None) -> list[OutputLine]:
        return []

    def subscribe(self, callback: Callable[[OutputLine], None]) -> Callable[[], None]:
        self.line_subscribers.append(callback)
        return lambda: self.line_subscribers.remove(callback)

    def subscribe_events(self, callback: Callable[[str, int, object], None]) -> Callable[[], None]:
        self.event_subscribers.append(callback)
        return lambda: self.event_subscribers.remove(callback)

    def add_done_callback(self, callback: Callable[[object], None]) -> None:
        self.done_callbacks.append(callback)

    def bars(self, rank: int | None = None, live_only: bool = False) -> list[BarState]:
        return [b for b in self.bar_states if rank is None or b.rank == rank]

    def stacks(self) -> dict:
        return {}

    def stop(self, grace: float = 1.0) -> None:
        self.stopped += 1

    def kill(self) -> None:
        self.stopped += 1

    # -- the test's hand -----------------------------------------------------------------------------
    def emit(self, rank: int, text: str, stream: str = "stdout", attempt: int = 1) -> None:
        """Send one line of ``rank`` to every subscriber."""
        for callback in list(self.line_subscribers):
            callback(OutputLine(rank, stream, text, time.time(), attempt))

    def finish(self, *states: str, error: LaunchError | None = None) -> None:
        """End the run: each rank in its state of ``states`` (one state: every rank in it), then the done callbacks."""
        for status, state in zip(self.statuses, states * len(self.statuses) if len(states) == 1 else states):
            status.state, status.ended_at = state, time.time()
        self.done, self.error = True, error
        for callback in self.done_callbacks:
            callback(self)
