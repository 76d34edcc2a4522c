"""The interfaces the launch core is written against, declared once (abstract base classes).

- ``WorkerProcess``: one started rank, here (``procs.LocalProcess``) or on another node
  (``nodes.workers.RemoteWorkerProcess``): its pid, a public ``sentinel`` to wait on, poll and signals.
- ``StackSource`` / ``UsageSource``: where the handle reads its ranks' Python stacks and CPU/memory
  figures from (``doctor.StackCollector`` / ``usage.UsageSampler`` here, the agents' answers across nodes).
- ``WorkerBackend``: where ranks run: it starts them and gives the stack and usage sources of its ranks
  (``procs.LocalProcesses`` on this machine, ``nodes.remote.NodeGroup`` across nodes). Its ranks report
  either over pipes (``pushes`` False: the write ends in ``WorkerStart``, the exit by ``sentinel``) or
  by pushing events into a ``RankEvents`` (``pushes`` True: ``WorkerStart.inbox``, no descriptor per rank).
- ``RankEvents``: what a pushing backend's ranks report to the supervisor: bytes of a stream, a
  stream's end, the exit (``inbox.RankInbox``).
- ``RunView``: the read-only view of a run that panels, magics and cell bars read (``LaunchHandle``,
  ``RestartingHandle``); the panel checks it with ``isinstance``. Its part that live progress bars
  read is ``BarSource`` (also implemented by one interactive command's bars).

A class that misses a member cannot be instantiated (``TypeError`` naming it), so a side that
drifts from the interface fails at once, in tests/test_launch_interfaces.py. This module imports
nothing of ours (the modules implementing it import it), so the types it names are in words.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BarSource",
    "RankEvents",
    "RunView",
    "StackSource",
    "UsageSource",
    "WorkerBackend",
    "WorkerProcess",
    "WorkerStart",
    "start_each",
]


class WorkerProcess(ABC):
    """A started worker: its pid, a descriptor that becomes readable when it ends, poll and signals."""

    pid: int | None
    """The worker's pid (on its own node); None until known."""
    sentinel: int | None
    """An fd that becomes readable once the worker ended (for ``selectors``); None: the supervisor polls."""
    exitcode: int | None
    """The exit code once the worker ended (negative: the signal that ended it), else None."""

    @property
    def pidfd(self) -> int | None:
        """Return a pidfd that signals this very process (never a recycled pid), or None (signal by pid)."""
        return None

    @abstractmethod
    def poll(self) -> int | None:
        """Return the exit code (negative: killed by that signal) once the worker has ended, else None."""

    @abstractmethod
    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's process group (what it started too); nothing once it ended."""

    @abstractmethod
    def kill_and_reap(self) -> None:
        """SIGKILL the worker's group and return once the worker itself has ended."""

    @abstractmethod
    def kill_leftovers(self) -> None:
        """SIGKILL what the worker started that still lives in its group (before it is reaped)."""

    @abstractmethod
    def close(self) -> None:
        """Release the sentinel and whatever else the parent holds for this worker."""

    def terminate(self) -> None:
        """Send SIGTERM to the worker's group."""
        self.signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """Send SIGKILL to the worker's group."""
        self.signal_group(signal.SIGKILL)


class StackSource(ABC):
    """Takes the live ranks' Python stacks (all threads) on demand; the ranks go on running."""

    @abstractmethod
    def path(self, rank: int) -> str:
        """Return the file rank ``rank`` dumps its stacks into ("" when chosen where the rank runs)."""

    @abstractmethod
    def collect(self, targets: dict[int, int]) -> dict[int, Any]:
        """Return ``{rank: doctor.RankStack}`` for ``targets`` (``{rank: pid}``) within seconds."""

    @abstractmethod
    def closed(self) -> bool:
        """Return True once the source was closed (a failed read then means no rank is live any more)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the source holds (its stacks files); idempotent."""


class UsageSource(ABC):
    """CPU and memory figures of the ranks, copied into their ``RankStatus`` about once a second."""

    @abstractmethod
    def due(self, now: float) -> bool:
        """Return True when the next sample is due (``now``: time.monotonic())."""

    @abstractmethod
    def sample(self, status: Any) -> None:
        """Update ``status`` (a ``RankStatus``) with its rank's latest figures."""

    @abstractmethod
    def forget(self, pid: int | None) -> None:
        """Drop what is cached for ``pid`` (its rank ended)."""


class RankEvents(ABC):
    """Where a pushing backend's ranks report, instead of pipes and a sentinel: one per launch, every rank in it.

    ``source`` is the ``WorkerProcess`` the backend returned for the rank; ``stream`` one of stdout,
    stderr, result. The events of one source are reported in the order pushed: push them from one
    thread at a time per source.
    """

    @abstractmethod
    def data(self, source: WorkerProcess, stream: str, data: bytes) -> None:
        """Report bytes the rank wrote to ``stream``; blocks while the receiver is behind (the bound a pipe gives)."""

    @abstractmethod
    def end(self, source: WorkerProcess, stream: str) -> None:
        """Report that the rank closed ``stream`` (once per stream; nothing of it follows)."""

    @abstractmethod
    def exited(self, source: WorkerProcess) -> None:
        """Report that the rank ended (its ``exitcode`` is set before)."""


@dataclass(frozen=True)
class WorkerStart:
    """What a backend needs to start one rank: its ``worker.WorkerSpec``, and where the rank reports.

    A pipe backend gets the write ends of the rank's three pipes; a pushing one (``WorkerBackend.pushes``)
    gets None for them and the launch's ``inbox`` instead.
    """

    spec: Any
    stdout: int | None
    stderr: int | None
    result: int | None
    inbox: RankEvents | None = None


class WorkerBackend(ABC):
    """Where a launch's ranks run: starts them, and says where their stacks and usage come from."""

    pushes: bool = False
    """False: each rank reports over its pipes and its ``sentinel``. True: its ranks push their output and
    exit into ``WorkerStart.inbox`` (no pipe, no sentinel, ``sentinel`` None and nothing polled)."""

    @abstractmethod
    def start(self, method: str, starts: Sequence[WorkerStart]) -> list[WorkerProcess]:
        """Return the started workers of ``starts``, in order (``method``: fork, spawn or forkserver).

        All or none: when one cannot start, those already started are killed and reaped, then it raises.
        The caller keeps (and closes) the pipes' write ends, and the inbox.
        """

    @abstractmethod
    def stack_source(self) -> StackSource:
        """Return a fresh stack source for one group of this backend's ranks."""

    @abstractmethod
    def usage_source(self) -> UsageSource:
        """Return a fresh usage source for one group of this backend's ranks."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend (end the agents of a launch across nodes); idempotent."""


def start_each(
    start_one: Callable[[str, WorkerStart], WorkerProcess], method: str, starts: Sequence[WorkerStart]
) -> list[WorkerProcess]:
    """Return ``start_one(method, s)`` for each of ``starts``: all or none, as ``WorkerBackend.start`` promises."""
    started: list[WorkerProcess] = []
    try:
        for start in starts:
            started.append(start_one(method, start))
    except BaseException:  # ^C while forking included: take down what was started
        for proc in started:
            proc.kill_and_reap()
            proc.close()
        raise
    return started


class BarSource(ABC):
    """What a cell's live progress bars read (``cell_bars.CellBars``): the bar events, the bars, the end.

    A run is one (``RunView``); so is one interactive command (``interactive.cell_output.CommandBars``:
    the events of the command's ranks, handed over on the cell's thread).
    """

    @abstractmethod
    def subscribe_events(self, callback: Callable[[str, int, Any], None]) -> Callable[[], None]:
        """Call ``callback(kind, rank, state)`` for each bar/metrics/usage event; return the unsubscribe function."""

    @abstractmethod
    def bars(self, rank: int | None = None, live_only: bool = False) -> list[Any]:
        """Return the progress bars' last states."""

    @abstractmethod
    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(run)`` once the run ended (at once if it has)."""


class RunView(BarSource):
    """The read-only view of a run (and its two verbs, stop and kill) that panels and magics read.

    The methods are abstract; the data members below are attributes or properties of the run (a
    class missing one is caught by tests/test_launch_interfaces.py, which compares the two handles).
    """

    num_processes: int
    done: bool
    error: Any
    """The run's ``LaunchError`` once it ended with one, else None."""
    hang_report: str | None
    live_bar_ranks: set[int] | None
    metrics: list[dict[str, Any]]
    dropped_lines: int
    attempt: int
    max_restarts: int
    restarting: bool
    attempts: list[Any]

    @abstractmethod
    def status(self) -> list[Any]:
        """Return a snapshot of every rank's ``RankStatus``."""

    @abstractmethod
    def stacks(self) -> dict[int, Any]:
        """Return every live rank's current stacks (``doctor.RankStack``)."""

    @abstractmethod
    def lines(self, rank: int | None = None) -> list[Any]:
        """Return the kept output lines (of ``rank``)."""

    @abstractmethod
    def subscribe(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``callback(line)`` for each new output line; return the unsubscribe function."""

    @abstractmethod
    def stop(self, grace: float = 1.0) -> None:
        """Stop every rank (SIGINT, then SIGTERM and SIGKILL)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop every rank with SIGKILL at once."""
