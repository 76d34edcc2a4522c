"""Per-rank output: lines cut from the workers' pipes, and the sinks that receive them.

A sink is any callable taking an ``OutputLine``; a sink that also has an ``announce(text)`` method
receives the launcher's own messages (the launch plan). ``PrintSink`` prints to the stream of the
calling cell with a ``[rank N]`` prefix; ``LogDirSink`` writes ``<dir>/<run_id>/rank_<N>/stdout.log``
and ``stderr.log`` like torch elastic.
"""

from __future__ import annotations

import codecs
import logging
import re
import string
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["LineSplitter", "LogDirSink", "OutputLine", "PrintSink", "format_prefix"]

logger = logging.getLogger(__name__)

_LINE_END = re.compile(r"(\n|\r)")


@dataclass(frozen=True)
class OutputLine:
    """One line a worker wrote (``text`` has no trailing newline)."""

    rank: int
    stream: str
    """``"stdout"`` or ``"stderr"``."""
    text: str
    time: float
    """``time.time()`` when the parent read the line."""
    attempt: int = 1
    """Which try of the launch wrote it: 2 and up after restarts (``max_restarts``)."""


class LineSplitter:
    """Cut decoded bytes of one stream into lines; ``\\r`` (progress bars) also ends a line."""

    def __init__(self, rank: int, stream: str, emit: Callable[[OutputLine], None]) -> None:
        self.rank, self.stream, self._emit = rank, stream, emit
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> None:
        """Emit every complete line in ``data`` (plus what was pending)."""
        text = (self._pending + self._decoder.decode(data)).replace("\r\n", "\n")
        # A final \r stays pending: the next chunk may start with the \n of a \r\n.
        held = "\r" if text.endswith("\r") else ""
        parts = _LINE_END.split(text[: len(text) - len(held)])
        now = time.time()
        # parts = [line, separator, line, separator, ..., rest]
        for i in range(0, len(parts) - 1, 2):
            piece = parts[i]
            if piece or parts[i + 1] == "\n":  # an empty \r-ended piece is a redraw, not a line
                self._emit(OutputLine(self.rank, self.stream, piece, now))
        self._pending = parts[-1] + held

    def close(self) -> None:
        """Emit what is left without a final newline."""
        rest = (self._pending + self._decoder.decode(b"", final=True)).rstrip("\r")
        self._pending = ""
        if rest:
            self._emit(OutputLine(self.rank, self.stream, rest, time.time()))


def format_prefix(
    template: str | None, rank: int, local_rank: int, role_name: str = "default", attempt: int = 1
) -> str:
    """Return the line prefix for ``rank``: ``"[rank N] "`` (``"[rank N, attempt A] "`` after a restart) or ``template`` filled in.

    Both torchrun's ``${rank}`` placeholders and ``{rank}`` format fields are accepted
    (``rank``, ``local_rank``, ``role_name``, ``attempt``).
    """
    if template is None:
        return f"[rank {rank}] " if attempt == 1 else f"[rank {rank}, attempt {attempt}] "
    values = {"rank": rank, "local_rank": local_rank, "role_name": role_name, "attempt": attempt}
    text = string.Template(template).safe_substitute(values)
    try:
        return text.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"log_line_prefix_template={template!r} cannot be formatted ({exc!r}); "
            "use the fields {rank}, {local_rank}, {role_name} and {attempt}"
        ) from None


class PrintSink:
    """Print every line to the caller's stdout/stderr (a notebook cell's streams) with a rank prefix."""

    def __init__(
        self,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        prefix_template: str | None = None,
        num_processes: int = 1,
        node_rank: int = 0,
    ) -> None:
        # Bound now: in a kernel, sys.stdout at call time is the stream of the running cell.
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self._template = prefix_template
        self._n = max(1, num_processes)
        self._node_rank = node_rank
        self._prefixes: dict[tuple[int, int], str] = {}

    def _prefix(self, rank: int, attempt: int = 1) -> str:
        prefix = self._prefixes.get((rank, attempt))
        if prefix is None:
            local = rank - self._node_rank * self._n
            prefix = self._prefixes[(rank, attempt)] = format_prefix(
                self._template, rank, local, attempt=attempt
            )
        return prefix

    def announce(self, text: str) -> None:
        """Print a message of the launcher itself."""
        self._write(self.stdout, text + "\n")

    def __call__(self, line: OutputLine) -> None:
        self.write(line)

    def write(self, line: OutputLine) -> None:
        """Print ``line`` now, from the calling thread."""
        stream = self.stderr if line.stream == "stderr" else self.stdout
        self._write(stream, f"{self._prefix(line.rank, line.attempt)}{line.text}\n")

    @staticmethod
    def _write(stream: IO[str], text: str) -> None:
        try:
            stream.write(text)
            stream.flush()
        except (ValueError, OSError):  # the cell's stream was closed; keep the launch going
            logger.debug("output stream closed; dropped %r", text)


class LogDirSink:
    """Write each rank's streams to ``<log_dir>/<run_id>/rank_<N>/{stdout,stderr}.log``.

    After a restart (``max_restarts``) the same files go on, each new attempt's lines after a
    ``----- attempt A -----`` line, so one file tells the rank's whole story in order.
    """

    def __init__(self, log_dir: str | Path, run_id: str, ranks: range) -> None:
        self.run_dir = Path(log_dir) / run_id
        self._files: dict[tuple[int, str], IO[str]] = {}
        self._attempts: dict[tuple[int, str], int] = {}  # the attempt whose lines each file holds last
        for rank in ranks:
            folder = self.run_dir / f"rank_{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            for stream in ("stdout", "stderr"):
                self._files[(rank, stream)] = open(folder / f"{stream}.log", "w", encoding="utf-8")  # noqa: SIM115

    def path(self, rank: int, stream: str = "stdout") -> Path:
        """Return the log file of ``rank``'s ``stream``."""
        return self.run_dir / f"rank_{rank}" / f"{stream}.log"

    def announce(self, text: str) -> None:
        """Keep the launch plan next to the logs."""
        with open(self.run_dir / "launch.txt", "a", encoding="utf-8") as f:
            f.write(text + "\n")

    def __call__(self, line: OutputLine) -> None:
        key = (line.rank, line.stream)
        f = self._files.get(key)
        if f is not None and not f.closed:
            if self._attempts.get(key, 1) != line.attempt:
                self._attempts[key] = line.attempt
                f.write(f"----- attempt {line.attempt} -----\n")
            f.write(line.text + "\n")
            f.flush()

    def close(self) -> None:
        """Close every file (idempotent)."""
        for f in self._files.values():
            f.close()
