"""``RankInbox``: the ranks of a pushing backend report here, one wake descriptor for all of them.

A backend whose ranks live elsewhere (``nodes.remote.NodeGroup``) pushes each rank's bytes, the end
of each stream and its exit from its own threads (``interfaces.RankEvents``); the supervisor
(``supervisor.RankSupervisor``) waits on ``fileno()`` beside its pipes and takes the events in the
order they were pushed. So a thousand remote ranks cost one descriptor, not eight each. The bytes
queued are bounded per rank, as a pipe bounds them: a pusher waits while the supervisor is behind.

The push takes no lock (a hundred node threads pushing through one lock queue up on it whenever
one of them loses the interpreter inside it): the events go into a deque (``append`` and
``popleft`` are atomic), each rank's counters have one writer each (its pusher, which the
interface serialises per rank, or the reader), and only a pusher that must wait, and the wake
write once per batch, take the lock.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

from .interfaces import RankEvents, WorkerProcess

__all__ = ["QUEUED_BYTES", "RankInbox", "Wake"]

QUEUED_BYTES = 1 << 18
"""How many bytes of one rank's output wait in an inbox at most before its pusher waits (one chunk may pass it)."""
# The data one ``take`` hands over at most (the supervisor reports it under its lock), as one pipe read.
_TAKE_BYTES = 1 << 16
_ROOM_POLL = 0.05  # a waiting pusher looks again this often (a wake may cross its start)
_ONE = (1).to_bytes(8, sys.byteorder)  # what an eventfd adds (a pipe takes any bytes)


class RankInbox(RankEvents):
    """A thread-safe queue of ``(kind, source, stream, data)`` events and the descriptor that wakes its reader.

    ``kind`` is "data", "end" or "exit". Pushed from any thread (one at a time per source); taken by one
    reader, the supervisor, about ``_TAKE_BYTES`` at a time. Once closed, pushes are dropped and a
    pusher waiting for room returns.
    """

    def __init__(self, max_bytes: int = QUEUED_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(
                f"max_bytes={max_bytes!r}: an inbox holds at least one byte; give a positive size"
            )
        self.max_bytes = max_bytes
        self._events: collections.deque[tuple[str, Any, str | None, bytes | None]] = collections.deque()
        # Per source, each written by one side only: bytes and events pushed (pusher), taken (reader).
        self._bytes_in: dict[Any, int] = {}
        self._bytes_out: dict[Any, int] = {}
        self._pushed: dict[Any, int] = {}
        self._taken: dict[Any, int] = {}
        self._armed = True  # the reader waits: the next push writes the wake
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._waiting = 0  # pushers waiting for room
        self._reading = False  # a reader takes the events (``attach``): only then is waiting for room of use
        self._closed = False
        self._wake_fd = Wake()

    # ------------------------------------------------------------------ the pushers' side

    def data(self, source: WorkerProcess, stream: str, data: bytes) -> None:
        """Queue ``data`` of ``source``'s ``stream``; wait while ``max_bytes`` of ``source`` are queued already."""
        if not data or self._closed:
            return
        queued = self._bytes_in.get(source, 0) - self._bytes_out.get(source, 0)
        if queued and queued + len(data) > self.max_bytes and self._reading:
            self._wait_for_room(source, len(data))
        self._bytes_in[source] = self._bytes_in.get(source, 0) + len(data)
        self._push(("data", source, stream, data))

    def _wait_for_room(self, source: Any, size: int) -> None:
        with self._room:
            self._waiting += 1
            try:
                while not self._closed:
                    queued = self._bytes_in.get(source, 0) - self._bytes_out.get(source, 0)
                    if not queued or queued + size <= self.max_bytes:
                        return
                    self._room.wait(_ROOM_POLL)
            finally:
                self._waiting -= 1

    def end(self, source: WorkerProcess, stream: str) -> None:
        """Queue the end of ``source``'s ``stream``."""
        self._push(("end", source, stream, None))

    def exited(self, source: WorkerProcess) -> None:
        """Queue ``source``'s exit."""
        self._push(("exit", source, None, None))

    def _push(self, event: tuple[str, Any, str | None, bytes | None]) -> None:
        if self._closed:
            return
        source = event[1]
        self._pushed[source] = self._pushed.get(source, 0) + 1  # before the append: pending at once
        self._events.append(event)
        if self._armed:  # set by the reader before it looks at the queue a last time
            self._armed = False
            self._wake()

    def _wake(self) -> None:
        with self._lock:  # never a write into a descriptor closed (and its number reused) meanwhile
            if not self._closed:
                self._wake_fd.set()

    # ------------------------------------------------------------------ the supervisor's side

    def attach(self) -> None:
        """Say that a reader takes the events from now on: pushers past ``max_bytes`` wait for it from now on.

        Before, nobody drains the inbox (a start under way, or one that failed and takes its ranks down,
        waiting for their exits behind their output): a pusher that waited then would wait for ever.
        """
        self._reading = True

    def fileno(self) -> int:
        """Return the descriptor that is readable while events wait."""
        return self._wake_fd.fileno()

    def take(self) -> list[tuple[str, Any, str | None, bytes | None]]:
        """Return the oldest events waiting (``_TAKE_BYTES`` of data at most; the wake stays set while more wait)."""
        events, taken, size = self._events, [], 0
        while events and size < _TAKE_BYTES:
            event = events.popleft()
            taken.append(event)
            source, data = event[1], event[3]
            self._taken[source] = self._taken.get(source, 0) + 1
            if data is not None:
                size += len(data)
                self._bytes_out[source] = self._bytes_out.get(source, 0) + len(data)
        if not events:
            self._armed = True  # first: a push from now on writes the wake
            self._wake_fd.clear()
            if events:  # pushed before it saw the flag: its wake may have been cleared
                self._wake()
        if self._waiting:
            with self._room:
                self._room.notify_all()
        return taken

    def pending(self, source: WorkerProcess) -> bool:
        """Return True while events of ``source`` wait to be taken."""
        return self._pushed.get(source, 0) > self._taken.get(source, 0)

    def pending_of(self, sources: Iterable[WorkerProcess]) -> set[WorkerProcess]:
        """Return those of ``sources`` whose events wait to be taken."""
        pushed, taken = self._pushed, self._taken
        return {source for source in sources if pushed.get(source, 0) > taken.get(source, 0)}

    def close(self) -> None:
        """Drop what waits, release the pushers waiting for room, close the descriptor; idempotent."""
        with self._room:
            if self._closed:
                return
            self._closed = True
            self._events.clear()
            self._taken.update(self._pushed)
            self._room.notify_all()
            self._wake_fd.close()


class Wake:
    """A descriptor a selector waits on, made readable from any thread: one eventfd where the platform has it, else a pipe.

    The caller makes sure ``set`` never runs after ``close`` (the number could belong to another file by then).
    """

    def __init__(self) -> None:
        eventfd = getattr(os, "eventfd", None)  # Linux, Python 3.10+
        if eventfd is not None:
            self._read_fd = self._write_fd = eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        """Return the descriptor to wait on (readable once ``set``)."""
        return self._read_fd

    def set(self) -> None:
        """Make the descriptor readable (until ``clear``)."""
        os.write(self._write_fd, _ONE)

    def clear(self) -> None:
        """Read what ``set`` wrote: the descriptor is not readable any more."""
        try:
            while os.read(self._read_fd, 1 << 12):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close the descriptor(s)."""
        for fd in {self._read_fd, self._write_fd}:
            os.close(fd)
