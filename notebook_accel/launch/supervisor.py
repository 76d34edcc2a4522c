"""``RankSupervisor``: waits on the ranks this process started, and says what each one did.

One selector holds every rank's pipe read ends (stdout, stderr, result) and the descriptor that
becomes readable when its process exits (a pidfd; where there is none, the exits are polled). The
ranks of a pushing backend (``WorkerBackend.pushes``: ranks on other nodes) have neither: they push
the same events into one ``inbox.RankInbox``, whose single descriptor is in the selector. The
supervisor reads what is ready and reports it per rank: data on a pipe, the end of a pipe (the read
end is closed then), and the exit (the process reaped, what it left behind killed). What the bytes
mean (lines, result frames) and what an exit decides stay with the caller: the launch handle
(``handle.py``) in the kernel, the node agent on another machine.

A rank is any object with ``proc`` (a ``WorkerProcess``), ``fds`` (``{read end: pipe name}``, kept
up to date here; empty for a pushed rank) and ``exited`` (set here once the process is reaped).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Protocol

from .inbox import RankInbox
from .interfaces import WorkerBackend, WorkerProcess, WorkerStart

__all__ = [
    "PIPES", "RankInbox", "RankSupervisor", "Signals", "Supervised", "open_pipes", "start_over_pipes", "start_workers",
]  # fmt: skip

PIPES = ("stdout", "stderr", "result")  # the pipes of every worker, in WorkerStart's order
DRAIN_SECONDS = 2.0  # after the last exit, how long pipes held by stray descendants may stay open
_READ = 1 << 16


class Supervised(Protocol):
    """What the supervisor needs of a rank."""

    proc: WorkerProcess | None
    fds: dict[int, str]
    exited: bool


def open_pipes(rank: Supervised, writes: list[int]) -> tuple[int, ...]:
    """Open the pipes of ``rank``: read ends into ``rank.fds``, write ends appended to ``writes`` and returned."""
    ends = []
    for name in PIPES:
        read_end, write_end = os.pipe()
        rank.fds[read_end] = name
        writes.append(write_end)
        ends.append(write_end)
    return tuple(ends)


class Signals:
    """The signals sent to the ranks' process groups: one now, each next one of a stop ``grace`` s after the last."""

    def __init__(self, ranks: list[Supervised]) -> None:
        self._ranks = ranks
        self.sent: set[int] = set()
        """Every signal sent (a rank killed by one of them was stopped, not failed)."""
        self.planned: list[tuple[float, int]] = []  # (when, signal) of the stop under way

    def escalate(self, signals: list[int], grace: float, now: float) -> None:
        """Send the first of ``signals`` now, and plan the others ``grace`` s apart (replacing a plan made)."""
        first, *later = signals
        self.planned = [(now + grace * (i + 1), s) for i, s in enumerate(later)]
        self.send(first)

    def send_due(self, now: float) -> None:
        """Send the planned signals whose time has come."""
        while self.planned and self.planned[0][0] <= now:
            self.send(self.planned.pop(0)[1])

    def send(self, signum: int) -> None:
        """Send ``signum`` to the process group of every rank still running."""
        self.sent.add(signum)
        for r in self._ranks:
            if r.proc is not None and not r.exited:
                r.proc.signal_group(signum)


def start_workers(
    backend: WorkerBackend,
    start_method: str,
    ranks: list[Supervised],
    make_starts: Callable[[list[tuple[int, ...]], list[int]], list[WorkerStart]],
) -> tuple[list[WorkerProcess], RankInbox | None]:
    """Start ``ranks`` on ``backend``: over pipes, or (``backend.pushes``) reporting into the inbox returned.

    A pushing backend's starts have no pipe ends (``make_starts`` gets None for them) and the inbox;
    on a failed start the inbox is closed.
    """
    if not backend.pushes:
        return start_over_pipes(backend, start_method, ranks, make_starts), None
    inbox = RankInbox()
    try:
        starts = make_starts([(None, None, None)] * len(ranks), [])
        return backend.start(start_method, [replace(s, inbox=inbox) for s in starts]), inbox
    except BaseException:
        inbox.close()
        raise


def start_over_pipes(
    backend: WorkerBackend,
    start_method: str,
    ranks: list[Supervised],
    make_starts: Callable[[list[tuple[int, ...]], list[int]], list[WorkerStart]],
) -> list[WorkerProcess]:
    """Start ``ranks`` over pipes opened now; ``make_starts(ends, writes)`` makes their starts from the write ends.

    The parent's write ends are closed once the workers hold them. On a failed start (or ^C while
    forking) the backend took down what it started, and every descriptor opened here is closed.
    """
    writes: list[int] = []
    try:
        ends = [open_pipes(r, writes) for r in ranks]
        try:
            return backend.start(start_method, make_starts(ends, writes))
        finally:
            for fd in writes:
                os.close(fd)
            writes.clear()
    except BaseException:
        for fd in writes:
            os.close(fd)
        for r in ranks:
            for fd in r.fds:
                os.close(fd)
            r.fds.clear()
        raise


class RankSupervisor:
    """Reads the pipes of the ranks (or their inbox) and reaps them, reporting each event to the callbacks given.

    ``on_data(rank, name, data)`` and ``on_eof(rank, name)`` run with ``lock`` held, taken before the
    read: whoever holds the lock sees every read either not begun or reported. ``on_exit(rank)``
    runs once the process is reaped. A ``selector`` of the caller's may be shared (the node agent
    waits on its connections with it too): ``dispatch`` then takes the keys that are ours. With an
    ``inbox`` (``start_workers``), every rank added reports through it: the supervisor owns it then.
    """

    def __init__(
        self,
        on_data: Callable[[Any, str, bytes], None],
        on_eof: Callable[[Any, str], None],
        on_exit: Callable[[Any], None],
        *,
        lock: contextlib.AbstractContextManager | None = None,
        selector: selectors.BaseSelector | None = None,
        inbox: RankInbox | None = None,
    ) -> None:
        self._on_data, self._on_eof, self._on_exit = on_data, on_eof, on_exit
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._own_selector = selector is None
        self.selector = selectors.DefaultSelector() if selector is None else selector
        self.ranks: list[Any] = []
        self.polling = False
        """True when some rank has no exit descriptor: its exit is found by ``poll_exits``."""
        self.drain_deadline: float | None = None
        """Once every rank exited with pipes still open: when ``over`` stops waiting for them."""
        self.inbox = inbox
        self._pushed: dict[WorkerProcess, Any] = {}  # a pushed rank's process -> the rank
        self._streams: dict[Any, set[str]] = {}  # a pushed rank -> its streams not ended yet
        if inbox is not None:
            self.selector.register(inbox.fileno(), selectors.EVENT_READ, (self, None, "inbox"))
            inbox.attach()

    def add(self, ranks: Iterable[Supervised]) -> None:
        """Watch ``ranks``: their pipe read ends (made non-blocking) and exit descriptors, or their inbox."""
        ranks = list(ranks)
        self.ranks.extend(ranks)  # all of them, for close(), even if a registration fails
        for rank in ranks:
            if self.inbox is not None:
                self._pushed[rank.proc] = rank
                self._streams[rank] = set(PIPES)
                continue
            for fd, name in rank.fds.items():
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_READ, (self, rank, name))
            if rank.proc.sentinel is not None:
                self.selector.register(rank.proc.sentinel, selectors.EVENT_READ, (self, rank, "exit"))
            else:
                self.polling = True

    def forget(self, rank: Supervised) -> None:
        """Stop holding ``rank``, which exited with its pipes closed; its caller releases its process."""
        self.ranks.remove(rank)

    def wait(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` s (None: until something happens) and report what is ready."""
        for key, _ in self.selector.select(timeout):
            self.dispatch(key)

    def dispatch(self, key: selectors.SelectorKey) -> bool:
        """Report what the ready ``key`` says; return False when it is not one of ours."""
        if not (isinstance(key.data, tuple) and len(key.data) == 3 and key.data[0] is self):
            return False
        _, rank, name = key.data
        if name == "inbox":
            self._take_inbox()
        elif name == "exit":
            self.selector.unregister(key.fd)
            self._reaped(rank)
        elif key.fd in rank.fds:
            with self._lock:
                self._read(rank, key.fd, name)
        return True

    def _read(self, rank: Supervised, fd: int, name: str) -> None:
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return
        if data:
            self._on_data(rank, name, data)
            return
        self.selector.unregister(fd)
        os.close(fd)
        del rank.fds[fd]
        self._on_eof(rank, name)

    def _take_inbox(self) -> None:
        """Report the events the inbox holds, in their order per rank and stream; the exits once the lock is released.

        The bytes of one stream taken together are reported as one piece (as one read of its pipe would
        be): a thousand ranks' small chunks cost a call per stream, not per chunk.
        """
        exits = []
        with self._lock:  # taken and reported under the lock: a holder sees each event waiting or reported
            pieces: dict[tuple[Any, str], list[bytes]] = {}
            for kind, source, stream, data in self.inbox.take():
                rank = self._pushed.get(source)
                if rank is None:
                    continue
                if kind == "data" and stream in self._streams[rank]:
                    pieces.setdefault((rank, stream), []).append(data)
                elif kind == "end" and stream in self._streams[rank]:
                    self._report(rank, stream, pieces.pop((rank, stream), None))
                    self._streams[rank].discard(stream)
                    self._on_eof(rank, stream)
                elif kind == "exit":
                    exits.append(rank)
            for (rank, stream), chunks in pieces.items():
                self._report(rank, stream, chunks)
        for rank in exits:
            if not rank.exited:
                self._reaped(rank)

    def _report(self, rank: Supervised, stream: str, chunks: list[bytes] | None) -> None:
        if chunks:
            self._on_data(rank, stream, chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def poll_exits(self) -> None:
        """Find and report the exits that no descriptor announced (or not yet); a pushed rank's exit is an event."""
        for rank in self.ranks:
            if not rank.exited and rank.proc not in self._pushed and rank.proc.poll() is not None:
                sentinel = rank.proc.sentinel
                if sentinel is not None and sentinel in self.selector.get_map():
                    self.selector.unregister(sentinel)
                self._reaped(rank)

    def _reaped(self, rank: Supervised) -> None:
        rank.proc.kill_leftovers()  # before reaping, while the group id is still certainly ours
        while rank.proc.poll() is None:
            time.sleep(0.001)
        rank.exited = True
        self._on_exit(rank)

    def over(self, now: float) -> bool:
        """Return True once every rank exited and its pipes are drained (or ``DRAIN_SECONDS`` passed)."""
        if not all(r.exited for r in self.ranks):
            return False
        if all(not r.fds and not self._streams.get(r) for r in self.ranks):
            return True
        self.drain_deadline = self.drain_deadline or now + DRAIN_SECONDS
        return now >= self.drain_deadline

    def close(self) -> None:
        """Close the inbox and every read end left, kill and reap a rank still running, release the processes."""
        if self.inbox is not None:  # first: a pusher waiting for room returns, later pushes are dropped
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.inbox.fileno())
            self.inbox.close()
        for rank in self.ranks:
            for fd in list(rank.fds):
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(fd)
                os.close(fd)
            rank.fds.clear()
            if rank.proc is not None:
                if not rank.exited:  # only after a crash of the caller
                    rank.proc.kill_and_reap()
                    rank.exited = True
                rank.proc.close()
        if self._own_selector:
            self.selector.close()
