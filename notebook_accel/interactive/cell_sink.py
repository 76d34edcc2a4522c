"""Where the interactive ranks' lines go: into the cell of the running command, identical lines collapsed.

During a command (``begin`` .. ``end``) the launcher's supervising thread only queues each line; the
command's own thread prints them (``flush``, every few milliseconds while it waits for the ranks), so
they land in the running cell. Lines the command's ranks print alike go out once, labelled with their
ranks (``launch.collapse``: held at most ``window`` seconds, everything printed by the end of the
command). Between commands a line prints at once, as it comes.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from ..launch.collapse import Collapser
from ..launch.output import OutputLine, PrintSink

__all__ = ["CellSink"]


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
