"""Where each rank of a launch stands: ``RankStatus`` (public snapshot) and ``_Rank`` (the parent's books).

The books decide what a rank's messages and exit say: its result or failure, and its final state.
"""

from __future__ import annotations

import collections
import signal
import time
from dataclasses import dataclass
from typing import Any

from .doctor import RankStack, describe_stacks, named_ranks
from .errors import LaunchError, RankFailure, death_notes, order_failures, signal_name
from .events import FrameDecoder
from .hangs import returned_note
from .output import LineSplitter
from .procs import WorkerProcess
from .states import State

__all__ = ["RankStatus", "launch_error", "settle_all"]

_STDERR_TAIL = 300  # stderr lines kept per rank (room for a faulthandler dump of every thread)


@dataclass
class RankStatus:
    """Where one rank stands."""

    rank: int
    pid: int | None
    state: State
    """``STARTING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``STOPPED`` (a ``State``: equal to ``"running"``...)."""
    started_at: float
    ended_at: float | None = None
    exitcode: int | None = None
    last_line: str = ""
    cpu_percent: float | None = None
    """CPU % of the worker process (100 = one core), sampled about once a second; at the end its
    average over the run. None only before the rank started."""
    rss: int | None = None
    """Resident memory of the worker process in bytes (the last sample once it ended)."""
    peak_rss: int | None = None
    """Highest resident memory seen (bytes), kept after the rank ended."""
    cuda_allocated: int | None = None
    """Bytes of CUDA memory held by tensors (None unless the rank initialised CUDA)."""
    cuda_reserved: int | None = None
    """Bytes of CUDA memory reserved by the caching allocator."""
    cuda_peak: int | None = None
    """Peak of ``cuda_allocated`` (torch.cuda.max_memory_allocated)."""
    attempt: int = 1
    """Which try of the launch this rank belongs to: 2 and up after restarts (``max_restarts``)."""
    node: str | None = None
    """The host the rank runs on in a launch across nodes (``nodes=``); None on this machine."""

    def __post_init__(self) -> None:
        self.state = State(self.state)  # "running" given by hand becomes State.RUNNING


class _Rank:
    """Parent-side bookkeeping of one worker."""

    def __init__(
        self, rank: int, local_rank: int, attempt: int = 1, node: int | None = None, host: str | None = None
    ) -> None:
        self.rank, self.local_rank, self.node = rank, local_rank, node
        self.proc: WorkerProcess | None = None
        self.status = RankStatus(rank, None, State.STARTING, time.time(), attempt=attempt, node=host)
        self.fds: dict[int, str] = {}  # open parent-side read ends -> "stdout" | "stderr" | "result"
        self.splitters: dict[str, LineSplitter] = {}
        self.decoder = FrameDecoder()
        self.result_done = False
        self.exited = False
        self.value: Any = None
        self.message: tuple | None = None
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self.last_activity = time.monotonic()

    def frames(self, data: bytes) -> list[tuple]:
        """Decode ``data`` of the result pipe: keep its last result message, return its events."""
        try:
            messages = self.decoder.feed(data)
        except Exception as exc:  # a class missing here, or bytes that are not ours
            messages = [
                ("err", type(exc).__name__, f"a message of rank {self.rank} could not be read: {exc}", "")
            ]
        events = []
        for message in messages:
            if message[0] == "event":
                events.append(message)
            else:
                self.message = message
        return events

    def result_failure(self, user_stopped: bool) -> RankFailure | None:
        """Take the result the rank sent (its value), or return the error it raised (unless a stop caused it)."""
        message = self.message
        if message is not None and message[0] == "ok":
            self.value = message[1]
        elif message is not None and message[0] == "err" and not user_stopped:
            _, exc_type, text, tb = message
            return RankFailure(self.rank, self.status.pid, exc_type, text, tb, time=time.monotonic())
        return None

    def outcome(self, user_stopped: bool, sent_signals: set[int]) -> tuple[State, RankFailure | None]:
        """Return the final state of a rank that exited with its result pipe drained, and the failure to add."""
        code = self.proc.exitcode
        kind = self.message[0] if self.message else None
        if kind == "ok":
            return State.SUCCEEDED, None
        if kind == "stopped" or (kind == "err" and user_stopped):
            return State.STOPPED, None
        if kind == "err":
            return State.FAILED, None
        if code is not None and code < 0 and -code in sent_signals:
            return State.STOPPED, None  # one of ours
        if code is not None and code < 0:
            name = signal_name(-code)
            hint = " (the out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
            failure = RankFailure(
                self.rank,
                self.status.pid,
                "Signal",
                f"killed by {name}{hint}",
                self.last_words(),
                exitcode=code,
                signal=name,
            )
        else:
            text = f"exited with code {code} before returning a result"
            failure = RankFailure(self.rank, self.status.pid, "ExitCode", text, "", exitcode=code)
        failure.time = time.monotonic()
        return State.FAILED, failure

    def last_words(self) -> str:
        """Return what a rank killed by a signal wrote last to stderr (faulthandler's dump among it)."""
        tail = death_notes(list(self.stderr_tail))
        return f"Last stderr lines of rank {self.rank}:\n{tail}" if tail else ""

    def timeout_failure(self, timeout: float, now: float) -> RankFailure:
        """Return the failure of a rank still running at the launch's ``timeout``."""
        text = f"still running after timeout={timeout} s (last line: {self.status.last_line!r})"
        return RankFailure(self.rank, self.status.pid, "TimeoutError", text, "", time=now)


def settle_all(ranks: list[_Rank], failures: list[RankFailure], timed_out: bool) -> None:
    """Give the ranks of a launch that is over their final state: those still live were stopped, and failed ones failed."""
    for r in ranks:
        if r.status.state.live:
            r.status.state = State.STOPPED
        for f in failures:
            if f.rank == r.rank and f.exc_type == "Signal":
                # Its exit can be seen before the rest of its stderr is read (faulthandler writes the dump
                # just before the process dies): the pipes are drained now.
                f.traceback = r.last_words()
            if f.rank == r.rank and r.status.state != State.FAILED:
                r.status.state = State.FAILED if not timed_out else State.STOPPED
                if f.exitcode is None:
                    f.exitcode = r.status.exitcode


def launch_error(
    ranks: list[_Rank],
    failures: list[RankFailure],
    stop_reason: str,
    timed_out: bool,
    stop_stacks: dict[int, RankStack] | None,
) -> LaunchError | None:
    """Return the error of a launch that is over (None: every rank returned)."""
    where = describe_stacks(stop_stacks) if stop_stacks else None
    nodes = {r.rank: r.status.node for r in ranks}
    if failures:
        failures = order_failures(failures)
        for failure in failures:
            failure.node = failure.node or nodes.get(failure.rank)
        returned = [r.rank for r in ranks if r.status.state == State.SUCCEEDED]
        summary = stop_reason if timed_out else returned_note(failures[0], returned, nodes)
        return LaunchError(failures, summary, stacks=where)
    unfinished = [r.rank for r in ranks if r.status.state != State.SUCCEEDED]
    if unfinished:
        text = f"launch {stop_reason or 'ended'}: {named_ranks(unfinished, nodes)} did not finish"
        return LaunchError([], text, stacks=where)
    return None
