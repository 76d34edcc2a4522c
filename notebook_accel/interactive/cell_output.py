"""Where an interactive group's output goes: into the cell running a command, from that cell's own thread.

A kernel routes what a thread prints or displays to the cell that started the thread; the thread
supervising the ranks was started by an earlier cell. So the ranks' lines are queued (``CellSink``)
and their progress-bar events collected (``CommandBars``), and the thread running the command
(``Group.exchange``) prints and draws them into its cell; between commands the lines are printed at once.
Lines the command's ranks print alike go out once, labelled with their ranks (``launch.collapse``: held at
most ``window`` seconds, everything printed by the end of the command).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..launch.cell_bars import CellBars, kernel_display
from ..launch.collapse import Collapser
from ..launch.handle import LaunchHandle
from ..launch.interfaces import BarSource
from ..launch.output import OutputLine, PrintSink

__all__ = ["CellSink", "CommandBars", "command_bars"]

logger = logging.getLogger(__name__)


class CellSink:
    """Where the group's lines go: queued for the thread of the running command, else printed at once."""

    def __init__(
        self, printing: bool, prefix_template: str | None, num_processes: int, window: float | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[OutputLine] | None = None
        self.printing = printing
        self._template, self._n = prefix_template, num_processes
        self.window = window
        """Seconds a line is held for the command's other ranks (None: lines are not collapsed)."""
        self._collapser: Collapser | None = None  # kept from command to command: what it learnt of lines
        self._printer: PrintSink | None = None  # the running command's, between begin and end
        self.last_line: dict[int, float] = {}
        """When each rank last wrote a line (``time.monotonic()``): a sign that it is not stuck."""
        self.hosts: tuple[str, ...] = ()  # ranks across nodes (``_n`` per node): lines labelled [n2 rank 3]

    def printer(self) -> PrintSink:
        """Return a PrintSink bound to the calling thread's streams now (a kernel's: the running cell)."""
        return PrintSink(prefix_template=self._template, num_processes=self._n, hosts=self.hosts)

    def __call__(self, line: OutputLine) -> None:
        self.last_line[line.rank] = time.monotonic()
        with self._lock:
            if self._queue is not None:
                self._queue.append(line)
                return
        if self.printing:
            self.printer().write(line)

    def announce(self, text: str) -> None:
        """Show the launcher's own messages (the plan), as notebook_launcher does."""
        if self.printing:
            self.printer().announce(text)

    def begin(self, printer: PrintSink, targets: Sequence[int] | None = None) -> None:
        """Queue the lines from now on, for ``flush`` into ``printer`` by the calling thread.

        ``targets``: the ranks the command runs on (None: every rank), whose identical lines collapse.
        """
        if self.window is not None:
            world = range(self._n * len(self.hosts)) if self.hosts else range(self._n)
            expected = world if targets is None else targets
            if self._collapser is None or self._collapser.window != self.window:
                self._collapser = Collapser(expected, self.window, self._print)
            self._collapser.expected = expected  # nothing is held between commands
            self._printer = printer
        with self._lock:
            self._queue = collections.deque()

    def _print(self, line: OutputLine, ranks: tuple[int, ...]) -> None:
        if self._printer is not None:
            self._printer.write(line, ranks)

    def flush(self, printer: PrintSink, everything: bool = False) -> None:
        """Print the queued lines from the calling thread; held ones too with ``everything``."""
        collapser = self._collapser if self._printer is not None else None
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._queue:
                    break
                line = self._queue.popleft()
            if collapser is None:
                printer.write(line)
            else:
                collapser.feed(line, now)
        if collapser is not None:
            collapser.flush() if everything else collapser.expire(now)

    def end(self, printer: PrintSink) -> None:
        """Print what is queued or held, then print later lines at once again."""
        self.flush(printer, everything=True)
        with self._lock:
            rest, self._queue = list(self._queue or ()), None
        for line in rest:
            printer.write(line)
        self._printer = None


class CommandBars(BarSource):
    """The ``BarSource`` of one command, for its ``CellBars``: the handle's bar events, passed on by ``pump()``.

    Each command draws the ranks' live progress bars in its own cell (the running one), as a
    blocking ``notebook_launcher`` does; nothing is drawn outside a kernel or with a panel. The
    events are handed to ``CellBars`` from the calling thread: a kernel sends what a thread
    displays to the cell that started the thread, and the supervising one was started by an
    earlier cell.
    """

    def __init__(self, handle: LaunchHandle, display: Callable[..., Any]) -> None:
        self._handle = handle
        self._events: collections.deque[tuple[str, int, Any]] = collections.deque()
        self._callbacks: list[Callable[[str, int, Any], None]] = []
        self._done: list[Callable[[Any], None]] = []
        self._unsubscribe = handle.subscribe_events(self._queue)
        self.view = CellBars(self, display)

    def _queue(self, kind: str, rank: int, item: Any) -> None:
        if kind == "bar":
            self._events.append((kind, rank, item))

    def subscribe_events(self, callback: Callable[[str, int, Any], None]) -> Callable[[], None]:
        """Call ``callback(kind, rank, state)`` for each bar event, on ``pump()``'s thread."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(self)`` when the command ends (``close()``)."""
        self._done.append(fn)

    def bars(self, rank: int | None = None, live_only: bool = False) -> list:
        """Return the handle's progress bars (of ``rank``; ``live_only``: open bars of live ranks)."""
        return self._handle.bars(rank, live_only)

    def pump(self) -> None:
        """Hand the bar events received so far to the view (from the calling thread)."""
        while self._events:
            event = self._events.popleft()
            for callback in self._callbacks:
                try:
                    callback(*event)
                except Exception:
                    logger.exception("drawing the command's bars failed")

    def close(self) -> None:
        """Stop following the bars and draw them one last time."""
        self._unsubscribe()
        self.pump()
        for fn in self._done:
            try:
                fn(self)
            except Exception:
                logger.exception("the last drawing of the command's bars failed")


def command_bars(handle: LaunchHandle, printing: bool) -> CommandBars | None:
    """Return the bars of a command that draws them in its cell (a kernel's, printing), else None."""
    display = kernel_display() if printing else None
    return CommandBars(handle, display) if display is not None else None
