"""Per-rank output: lines cut from the workers' pipes, and the sinks that receive them.

A sink is any callable taking an ``OutputLine``; a sink that also has an ``announce(text)`` method
receives the launcher's own messages (the launch plan). ``PrintSink`` prints to the stream of the
calling cell with a ``[rank N]`` prefix; ``LogDirSink`` writes ``<dir>/<run_id>/rank_<N>/stdout.log``
and ``stderr.log`` like torch elastic.
"""

from __future__ import annotations

import codecs
import collections
import ipaddress
import logging
import re
import string
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "announce",
    "dropped_note",
    "line_prefix",
    "rank_label",
    "HISTORY_BYTES",
    "HISTORY_LINES",
    "LineSplitter",
    "LogDirSink",
    "OutputHistory",
    "OutputLine",
    "PrintSink",
    "format_prefix",
    "node_span",
    "rank_span",
    "short_host",
    "span_text",
]

logger = logging.getLogger(__name__)

_LINE_END = re.compile(r"(\n|\r)")
_NUMBERED = re.compile(r"(.*?)(\d+)")
_NODES_NAMED = 4  # a label names at most this many node runs (else it counts the nodes)


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
    """Cut decoded bytes of one stream into lines; ``\\r`` (progress bars) also ends a line.

    Only the newly read text is searched for line ends; the unfinished line is kept as a list of
    pieces joined once it ends, so a line of any length costs time linear in its bytes.
    """

    def __init__(self, rank: int, stream: str, emit: Callable[[OutputLine], None]) -> None:
        self.rank, self.stream, self._emit = rank, stream, emit
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []  # the unfinished line, never holding a line end
        self._held_cr = False  # the last read ended in \r: the next may start with the \n of a \r\n

    def feed(self, data: bytes) -> None:
        """Emit every line that ``data`` completes."""
        text = self._decoder.decode(data)
        if self._held_cr:
            text = "\r" + text
        # One-character membership tests are memchr-fast; the regex runs only on text with line ends.
        self._held_cr = False
        if "\r" in text:
            text = text.replace("\r\n", "\n")
            self._held_cr = text.endswith("\r")
            if self._held_cr:
                text = text[:-1]
        if "\n" not in text and "\r" not in text:
            if text:
                self._pieces.append(text)
            return
        parts = _LINE_END.split(text)
        now = time.time()
        # parts = [line, separator, line, separator, ..., rest]; the first line began in earlier reads
        if self._pieces:
            self._pieces.append(parts[0])
            parts[0] = "".join(self._pieces)
            self._pieces = []
        for i in range(0, len(parts) - 1, 2):
            piece = parts[i]
            if piece or parts[i + 1] == "\n":  # an empty \r-ended piece is a redraw, not a line
                self._emit(OutputLine(self.rank, self.stream, piece, now))
        if parts[-1]:
            self._pieces.append(parts[-1])

    def close(self) -> None:
        """Emit what is left without a final newline."""
        held = "\r" if self._held_cr else ""
        rest = ("".join(self._pieces) + held + self._decoder.decode(b"", final=True)).rstrip("\r")
        self._pieces, self._held_cr = [], False
        if rest:
            self._emit(OutputLine(self.rank, self.stream, rest, time.time()))


HISTORY_LINES = 200_000
"""Output lines a launch keeps for late subscribers and ``lines()`` (the oldest go first)."""
HISTORY_BYTES = 64 << 20
"""Memory the kept lines' text may take (64 MiB): a few very long lines cannot fill the caller's memory."""


class OutputHistory:
    """The newest output lines of a launch, bounded in number and in memory; counts what it dropped.

    A line's size is the memory its text takes (``sys.getsizeof``). The newest line is always kept,
    even alone over the byte bound, so ``lines()`` never loses the last thing a rank said.
    """

    def __init__(self, max_lines: int | None = None, max_bytes: int | None = None) -> None:
        self.max_lines = HISTORY_LINES if max_lines is None else max_lines
        self.max_bytes = HISTORY_BYTES if max_bytes is None else max_bytes
        # Two deques side by side, not one of (line, size) pairs: a pair per line is one more object for
        # the garbage collector to track, which made an append 3-4x slower with many histories (a panel
        # keeps one per rank).
        self._lines: collections.deque[OutputLine] = collections.deque()
        self._sizes: collections.deque[int] = collections.deque()
        self.bytes = 0
        """Memory taken by the kept lines' text."""
        self.dropped_lines = 0
        self.dropped_bytes = 0

    def append(self, line: OutputLine) -> None:
        """Keep ``line``, dropping the oldest lines while over either bound."""
        size = sys.getsizeof(line.text)
        self._lines.append(line)
        self._sizes.append(size)
        self.bytes += size
        while len(self._lines) > 1 and (len(self._lines) > self.max_lines or self.bytes > self.max_bytes):
            self._lines.popleft()
            old = self._sizes.popleft()
            self.bytes -= old
            self.dropped_lines += 1
            self.dropped_bytes += old

    def __len__(self) -> int:
        return len(self._lines)

    def snapshot(self, rank: int | None = None) -> list[OutputLine]:
        """Return the kept lines, oldest first (of one ``rank`` or of all)."""
        if rank is None:
            return list(self._lines)
        return [line for line in self._lines if line.rank == rank]

    def dropped_text(self) -> str:
        """Return a note on the lines dropped to stay within the bounds ("" when none were)."""
        return dropped_note(
            self.dropped_lines,
            f" ({self.dropped_bytes / 2**20:.1f} MiB): the launch keeps the newest {self.max_lines} lines "
            f"and {self.max_bytes / 2**20:.0f} MiB of output",
        )


def dropped_note(lines: int, detail: str = "") -> str:
    """Return the note on ``lines`` oldest output lines no longer kept, ``detail`` after the count ("" for 0).

    The one wording of it: the history's ``dropped_text()`` and the launch panel both show it.
    """
    if not lines:
        return ""
    return f"{lines} older output line(s) dropped{detail} (log_dir=... keeps every line on disk)"


def short_host(host: str) -> str:
    """Return ``host`` without its domain (``gpu-b`` of ``gpu-b.cluster.org``); an IP address whole."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host.split(".")[0]
    return host


def span_text(numbers: Sequence[int]) -> str:
    """Return sorted distinct ``numbers`` as text, runs of three or more as ``first-last``: ``"0-3,5,7,8"``."""
    parts: list[str] = []
    start = prev = None
    for n in (*numbers, None):
        if prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            parts.append(
                f"{start}-{prev}" if prev - start >= 2 else ",".join(map(str, range(start, prev + 1)))
            )
        start = prev = n
    return ",".join(parts)


def node_span(names: Sequence[str]) -> str:
    """Return node names (in order, distinct) as one label: numbered runs of three or more as ``n1-n8``.

    ``("n1", ..., "n8")`` gives ``"n1-n8"``, ``("gpu-a", "gpu-b")`` gives ``"gpu-a,gpu-b"``; more than
    four such parts give the count (``"12 nodes"``): the rank set beside it stays exact.
    """
    runs: list[list[str]] = []
    last: tuple[str, int] | None = None  # (prefix, number) of the previous name
    for name in names:
        match = _NUMBERED.fullmatch(name)
        key = (match[1], int(match[2])) if match else None
        if runs and last is not None and key == (last[0], last[1] + 1):
            runs[-1].append(name)
        else:
            runs.append([name])
        last = key
    parts = [f"{run[0]}-{run[-1]}" if len(run) >= 3 else ",".join(run) for run in runs]
    if sum(len(run) if len(run) < 3 else 1 for run in runs) > _NODES_NAMED:
        return f"{len(names)} nodes"
    return ",".join(parts)


def format_prefix(
    template: str | None,
    rank: int | str,
    local_rank: int | str,
    role_name: str = "default",
    attempt: int = 1,
    node: str | None = None,
) -> str:
    """Return the line prefix for ``rank``: ``"[rank N] "`` (``"[rank N, attempt A] "`` after a restart) or ``template`` filled in.

    A launch across nodes names the rank's node first (``"[gpu-b rank 3] "``). Both torchrun's
    ``${rank}`` placeholders and ``{rank}`` format fields are accepted (``rank``, ``local_rank``,
    ``role_name``, ``attempt``, ``node``). A line that several ranks printed alike (``collapse``)
    passes their set as text (``rank="0-3,5"``, ``node="n1-n2"``): ``"[n1-n2 ranks 0-3,5] "``.
    """
    if template is None:
        return _default_prefix(rank, attempt, node)
    values = {
        "rank": rank,
        "local_rank": local_rank,
        "role_name": role_name,
        "attempt": attempt,
        "node": node or "",
    }
    text = string.Template(template).safe_substitute(values)
    try:
        return text.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"log_line_prefix_template={template!r} cannot be formatted ({exc!r}); "
            "use the fields {rank}, {local_rank}, {role_name}, {attempt} and {node}"
        ) from None


def rank_label(rank: int | str, node: str | None = None) -> str:
    """Return ``rank N``, or ``NODE rank N`` for a rank of a launch across nodes (tabs, bars and prefixes say it so).

    ``rank`` as text is a set of ranks (``span_text``'s ``"0-3,5"``): ``ranks 0-3,5``, ``n1-n2 ranks 0-3,5``.
    """
    word = "rank" if isinstance(rank, int) else "ranks"
    return f"{node} {word} {rank}" if node else f"{word} {rank}"


def rank_span(ranks: Sequence[int]) -> str:
    """Return ``"rank 5"`` for one rank, else ``"ranks "`` and the sorted set as ``span_text`` writes it (``"ranks 0-3,5"``)."""
    ordered = sorted(set(ranks))
    return rank_label(ordered[0] if len(ordered) == 1 else span_text(ordered))


def _default_prefix(rank: int | str, attempt: int = 1, node: str | None = None, mark: str = "") -> str:
    where = rank_label(rank, node) + mark
    return f"[{where}] " if attempt == 1 else f"[{where}, attempt {attempt}] "


def line_prefix(line: OutputLine, node: str | None = None) -> str:
    """Return the default prefix of ``line`` as a view shows it: ``format_prefix``'s, with ``!`` after the rank for stderr.

    ``[rank 3] ``, ``[rank 3!] `` (stderr), ``[gpu-b rank 3, attempt 2] ``.
    """
    return _default_prefix(line.rank, line.attempt, node, "!" if line.stream == "stderr" else "")


class PrintSink:
    """Print every line to the caller's stdout/stderr (a notebook cell's streams) with a rank prefix."""

    def __init__(
        self,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        prefix_template: str | None = None,
        num_processes: int = 1,
        node_rank: int = 0,
        hosts: tuple[str, ...] = (),
    ) -> None:
        # Bound now: in a kernel, sys.stdout at call time is the stream of the running cell.
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self._template = prefix_template
        self._n = max(1, num_processes)
        self._node_rank = node_rank
        self._hosts = hosts  # a launch across nodes: every rank, each labelled with its node's short name
        self._prefixes: dict[tuple[int, int], str] = {}

    def _prefix(self, rank: int, attempt: int = 1) -> str:
        prefix = self._prefixes.get((rank, attempt))
        if prefix is None:
            node = short_host(self._hosts[rank // self._n]) if self._hosts else None
            local = rank % self._n if self._hosts else rank - self._node_rank * self._n
            prefix = self._prefixes[(rank, attempt)] = format_prefix(
                self._template, rank, local, attempt=attempt, node=node
            )
        return prefix

    def _group_prefix(self, ranks: Sequence[int], attempt: int) -> str:
        """Return the prefix of a line all of ``ranks`` (sorted, two or more) printed: ``"[n1-n8 ranks 0-15] "``."""
        node = None
        if self._hosts:
            node = node_span(list(dict.fromkeys(short_host(self._hosts[r // self._n]) for r in ranks)))
            local = sorted({r % self._n for r in ranks})
        else:
            local = [r - self._node_rank * self._n for r in ranks]
        values = (span_text(ranks), span_text(local))
        try:
            return format_prefix(self._template, *values, attempt=attempt, node=node)
        except ValueError:  # a template formatting {rank} as a number ("{rank:03d}"): the default label
            return format_prefix(None, *values, attempt=attempt, node=node)

    def announce(self, text: str) -> None:
        """Print a message of the launcher itself."""
        self._write(self.stdout, text + "\n")

    def __call__(self, line: OutputLine) -> None:
        self.write(line)

    def write(self, line: OutputLine, ranks: Sequence[int] = ()) -> None:
        """Print ``line`` now, from the calling thread, labelled with its rank or with ``ranks`` (sorted).

        ``ranks``: every rank that printed this very line (``launch.collapse``); one rank: that rank's copy.
        """
        stream = self.stderr if line.stream == "stderr" else self.stdout
        if len(ranks) > 1:
            prefix = self._group_prefix(ranks, line.attempt)
        else:
            prefix = self._prefix(ranks[0] if ranks else line.rank, line.attempt)
        self._write(stream, f"{prefix}{line.text}\n")

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


def announce(sinks: Sequence[Callable[[OutputLine], None]], text: str, *, guard: bool = False) -> None:
    """Give ``text`` (a message of the launcher itself) to every sink that has ``announce``.

    With ``guard`` a failing sink is logged and the others still get the text (the supervising
    thread must not die of a view's error).
    """
    for sink in sinks:
        method = getattr(sink, "announce", None)
        if method is None:
            continue
        try:
            method(text)
        except Exception:
            if not guard:
                raise
            logger.exception("sink %r failed to show %r", sink, text[:80])
