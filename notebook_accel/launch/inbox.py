"""``RankInbox``: the ranks of a pushing backend report here, one wake descriptor for all of them.

A backend whose ranks live elsewhere (``nodes.remote.NodeGroup``) pushes each rank's bytes, the end
of each stream and its exit from its own threads (``interfaces.RankEvents``); the supervisor
(``supervisor.RankSupervisor``) waits on ``fileno()`` beside its pipes and takes the events in the
order they were pushed. So a thousand remote ranks cost one descriptor, not eight each. The bytes
queued are bounded: a pusher waits while the supervisor is behind, as a writer waits on a full pipe.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

from .interfaces import RankEvents, WorkerProcess

__all__ = ["QUEUED_BYTES", "RankInbox"]

QUEUED_BYTES = 1 << 22
"""How many bytes of output wait in an inbox at most before the pushers wait (one chunk may pass it)."""
_TAKE_BYTES = 1 << 18  # how much one ``take`` hands over (the supervisor reports it under its lock)
_ONE = (1).to_bytes(8, sys.byteorder)  # what an eventfd adds (a pipe takes any bytes)


class RankInbox(RankEvents):
    """A thread-safe queue of ``(kind, source, stream, data)`` events and the descriptor that wakes its reader.

    ``kind`` is "data", "end" or "exit". Pushed from any thread; taken by one reader, the supervisor.
    Once closed, pushes are dropped and a pusher waiting for room returns at once.
    """

    def __init__(self, max_bytes: int = QUEUED_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes!r}: an inbox must hold at least one byte; give a positive size")
        self.max_bytes = max_bytes
        self._events: collections.deque[tuple[str, Any, str | None, bytes | None]] = collections.deque()
        self._bytes = 0
        self._pending: collections.Counter[Any] = collections.Counter()
        self._room = threading.Condition()
        self._closed = False
        self._read_fd, self._write_fd = _wake_descriptors()

    # ------------------------------------------------------------------ the pushers' side

    def data(self, source: WorkerProcess, stream: str, data: bytes) -> None:
        """Queue ``data`` of ``source``'s ``stream``; wait while the queue holds ``max_bytes`` already."""
        if not data:
            return
        with self._room:
            while self._bytes and self._bytes + len(data) > self.max_bytes and not self._closed:
                self._room.wait()
            self._bytes += len(data)
            self._push(("data", source, stream, bytes(data)))

    def end(self, source: WorkerProcess, stream: str) -> None:
        """Queue the end of ``source``'s ``stream``."""
        with self._room:
            self._push(("end", source, stream, None))

    def exited(self, source: WorkerProcess) -> None:
        """Queue ``source``'s exit."""
        with self._room:
            self._push(("exit", source, None, None))

    def _push(self, event: tuple[str, Any, str | None, bytes | None]) -> None:
        if self._closed:
            return
        if not self._events:  # the reader empties the queue before it clears the wake: one write per batch
            os.write(self._write_fd, _ONE)
        self._events.append(event)
        self._pending[event[1]] += 1

    # ------------------------------------------------------------------ the supervisor's side

    def fileno(self) -> int:
        """Return the descriptor that is readable while events wait."""
        return self._read_fd

    def take(self) -> list[tuple[str, Any, str | None, bytes | None]]:
        """Return the events waiting, oldest first (about ``_TAKE_BYTES`` of data at most; the rest stays ready)."""
        taken, size = [], 0
        with self._room:
            while self._events and size < _TAKE_BYTES:
                event = self._events.popleft()
                self._pending[event[1]] -= 1
                if event[0] == "data":
                    size += len(event[3])
                taken.append(event)
            self._bytes -= size
            if not self._events:
                _clear(self._read_fd)
                self._pending.clear()
            self._room.notify_all()
        return taken

    def pending(self, source: WorkerProcess) -> bool:
        """Return True while events of ``source`` wait to be taken."""
        return bool(self.pending_of([source]))

    def pending_of(self, sources: Iterable[WorkerProcess]) -> set[WorkerProcess]:
        """Return those of ``sources`` whose events wait to be taken."""
        with self._room:
            return {source for source in sources if self._pending[source] > 0}

    def close(self) -> None:
        """Drop what waits, release the pushers waiting for room, close the descriptor; idempotent."""
        with self._room:
            if self._closed:
                return
            self._closed = True
            self._events.clear()
            self._pending.clear()
            self._bytes = 0
            self._room.notify_all()
            for fd in {self._read_fd, self._write_fd}:
                os.close(fd)


def _wake_descriptors() -> tuple[int, int]:
    """Return (read end, write end) of the wake: one eventfd where the platform has it, else a pipe."""
    eventfd = getattr(os, "eventfd", None)  # Linux, Python 3.10+
    if eventfd is not None:
        fd = eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd, fd
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    return read_end, write_end


def _clear(fd: int) -> None:
    try:
        while os.read(fd, 1 << 12):
            pass
    except BlockingIOError:
        pass
