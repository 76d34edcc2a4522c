"""``ChannelReader``: one thread reads the channels of several nodes (``NodeGroup`` gives it up to 16).

A thread per node would wake, take the interpreter and hand it back once per message of its node:
at 128 nodes an interactive command's 128 replies meant 128 thread switches in the kernel, and
the idle heartbeats as many wakes again. Here one selector waits on many channels; a wake reads
what each ready channel has (``Channel.read_ready``: often several frames in one system call) and
hands each verified frame to ``on_frame`` in the order it came, per channel. A channel that ends
(closed, or a frame failing its check) is dropped from the selector and reported once to
``on_closed``; so is one whose ``on_frame`` raised.

``on_frame`` runs on the reader's thread and holds up every channel while it runs: it may wait
only where the launch's own reader is behind (the inbox's room), as a pipe would make it wait.
"""

from __future__ import annotations

import logging
import selectors
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..launch.inbox import Wake
from .channel import Channel

__all__ = ["ChannelReader"]

logger = logging.getLogger(__name__)


class ChannelReader:
    """Read ``channels`` (``(channel, key)`` pairs) on one thread until ``close()``.

    ``on_frame(key, body)`` gets each verified frame body; ``on_closed(key, error)`` the end of a
    channel (ChannelError), or the exception ``on_frame`` raised (that channel is not read any more).
    """

    def __init__(
        self,
        channels: Iterable[tuple[Channel, Any]],
        on_frame: Callable[[Any, bytes], None],
        on_closed: Callable[[Any, Exception], None],
        name: str,
    ) -> None:
        self._on_frame, self._on_closed = on_frame, on_closed
        self._selector = selectors.DefaultSelector()
        self._wake = Wake()
        self._selector.register(self._wake.fileno(), selectors.EVENT_READ, None)
        for channel, key in channels:
            self._selector.register(channel.sock.fileno(), selectors.EVENT_READ, (channel, key))
        self._closed = False
        self._lock = threading.Lock()  # close() sets the wake before the thread closes it, never after
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def watched(self) -> int:
        """Return how many channels are still read."""
        return len(self._selector.get_map()) - 1

    def close(self) -> None:
        """Stop reading (the channels stay as they are): the thread ends once ``on_frame`` returns; idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._wake.set()

    def _run(self) -> None:
        try:
            while not self._closed:
                for selected, _ in self._selector.select():
                    if selected.data is not None and not self._closed:
                        self._read(selected.fd, *selected.data)
        finally:
            with self._lock:  # close() after this sets nothing (the descriptor's number may be reused)
                self._closed = True
                self._selector.close()
                self._wake.close()

    def _read(self, fd: int, channel: Channel, key: Any) -> None:
        bodies, error = channel.read_ready()
        try:
            for body in bodies:
                self._on_frame(key, body)
        except Exception as exc:  # its channel is read no more; the others go on
            logger.debug("reading channel %r failed", key, exc_info=True)
            error = exc
        if error is not None:
            self._selector.unregister(fd)
            self._on_closed(key, error)
