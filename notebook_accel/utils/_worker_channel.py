"""The worker's end of a launch's per-rank message channel: structured events for the launching process.

A worker started by ``notebook_launcher`` writes length-prefixed pickled messages on its result pipe:
events while it runs (``("event", kind, payload)``: progress-bar states, logged metrics, device
memory) and, last, its result. Code running in a worker calls :func:`send_event`; outside a launched
worker there is no channel and the call returns False, so callers fall back to what they do anyway.

Only the process that opened the channel writes on it: a process the worker forks (a DataLoader
worker) inherits the descriptor, but its events would interleave with the worker's own frames.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
from typing import Any

__all__ = ["FRAME_HEADER", "channel_open", "close_channel", "open_channel", "send_event"]

FRAME_HEADER = struct.Struct(">I")
"""Each message is ``FRAME_HEADER.pack(len(body)) + body``, body a pickle."""


class _Channel:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.closed = False

    def write(self, body: bytes) -> bool:
        view = memoryview(FRAME_HEADER.pack(len(body)) + body)
        with self.lock:
            if self.closed:
                return False
            while view:
                view = view[os.write(self.fd, view) :]
        return True


_channel: _Channel | None = None


def open_channel(fd: int) -> None:
    """Make ``fd`` (the write end of the result pipe) this process's channel to the launcher."""
    global _channel
    _channel = _Channel(fd)


def channel_open() -> bool:
    """Return True in a launched worker whose channel to the launcher is open."""
    channel = _channel
    return channel is not None and not channel.closed and channel.pid == os.getpid()


def send_event(kind: str, payload: dict[str, Any]) -> bool:
    """Return True after sending one event to the launcher; False where there is no channel.

    A failed write (the launcher went away) closes the channel rather than raising into the
    user's training loop: events are a view of the run, never a reason to stop it.
    """
    channel = _channel
    if channel is None or channel.closed or channel.pid != os.getpid():
        return False
    try:
        return channel.write(pickle.dumps(("event", kind, payload), protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        channel.closed = True
        return False


def close_channel(final: bytes) -> None:
    """Write the worker's last message (its pickled result) and close the channel; OSError if that fails."""
    global _channel
    channel, _channel = _channel, None
    if channel is None:
        return
    try:
        channel.write(final)
    finally:
        with channel.lock:
            channel.closed = True
            os.close(channel.fd)
