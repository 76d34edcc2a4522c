"""The kernel's connections to one group's ranks: bytes in and out, by connection (``RankLinks``).

The kernel<->rank protocol (``protocol.py``) travels as frames over a byte stream per rank. Where
the stream runs is the transport's business, declared once here:

- ``SocketLinks``: ranks on this machine connect to the kernel's Unix socket; one socket per rank,
  waited on with one ``poll`` object (registered once, not per wait).
- ``RelayedLinks``: ranks on other nodes connect to their agent's Unix socket, and the agent relays
  every stream over its one authenticated channel (``nodes/relay.py``). Nothing per rank in the
  kernel: a reader thread of the nodes queues what arrived (one message per node and round), and a
  command to many ranks leaves as one message per node, which the agent copies to each stream.

A connection is named by a key (a socket, or ``(node index, stream id)``) until its rank says
``Ready`` (``startup.accept_ranks``); ``Group`` then maps ranks to keys.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from typing import Any

from ..nodes.relay import StreamEnds

__all__ = ["RankLinks", "RelayedLinks", "SocketLinks"]

_READ = 1 << 20


class RankLinks(ABC):
    """The byte streams between the kernel and the ranks of one group."""

    @abstractmethod
    def wait(self, timeout: float) -> list[tuple[Hashable, bytes]]:
        """Return what arrived within ``timeout`` s: ``(connection, bytes)``, in order per connection.

        ``b""`` says that connection closed. A new connection first appears with its first bytes.
        """

    @abstractmethod
    def send(self, keys: Iterable[Hashable], frame: bytes) -> list[Hashable]:
        """Send ``frame`` on each connection of ``keys``; return those that are closed (nothing sent there)."""

    @abstractmethod
    def stop_accepting(self) -> None:
        """Take no new connection from now on (the group formed)."""

    @abstractmethod
    def close(self, keys: Iterable[Hashable] | None = None) -> None:
        """Close the connections of ``keys`` (None: every one, and stop accepting); idempotent."""


class SocketLinks(RankLinks):
    """Ranks on this machine: a listening Unix socket, then one connected socket per rank."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener: socket.socket | None = listener
        self._socks: dict[int, socket.socket] = {}  # fd -> socket
        # poll, not select: a kernel with many ranks holds descriptors past 1024.
        self._poller = select.poll()
        self._poller.register(listener, select.POLLIN)

    def wait(self, timeout: float) -> list[tuple[Hashable, bytes]]:
        """Return what the ranks' sockets hold (accepting new connections meanwhile)."""
        got: list[tuple[Hashable, bytes]] = []
        for fd, _ in self._poller.poll(max(0.0, timeout) * 1000):
            if self._listener is not None and fd == self._listener.fileno():
                conn = self._listener.accept()[0]
                self._socks[conn.fileno()] = conn
                self._poller.register(conn, select.POLLIN)
                continue
            sock = self._socks.get(fd)
            if sock is None:
                continue
            try:
                data = sock.recv(_READ, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                self._forget(sock)
            got.append((sock, data))
        return got

    def send(self, keys: Iterable[Hashable], frame: bytes) -> list[Hashable]:
        """Send ``frame`` to each socket; return the closed ones."""
        failed = []
        for sock in keys:
            try:
                sock.sendall(frame)  # type: ignore[attr-defined]
            except OSError:
                failed.append(sock)
        return failed

    def stop_accepting(self) -> None:
        """Close the listener."""
        if self._listener is not None:
            self._poller.unregister(self._listener)
            self._listener.close()
            self._listener = None

    def close(self, keys: Iterable[Hashable] | None = None) -> None:
        """Close the sockets of ``keys`` (None: all of them, and the listener)."""
        if keys is None:
            self.stop_accepting()
            keys = list(self._socks.values())
        for sock in keys:
            self._forget(sock)  # type: ignore[arg-type]
            sock.close()  # type: ignore[attr-defined]

    def _forget(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if fd >= 0 and self._socks.pop(fd, None) is not None:
            self._poller.unregister(fd)


class RelayedLinks(RankLinks, StreamEnds):
    """Ranks on other nodes: the streams their agents relay (``NodeGroup.relay``), queued as they arrive."""

    def __init__(self, relay: Any) -> None:
        self._relay = relay
        self._arrived: collections.deque[tuple[Hashable, bytes]] = collections.deque()
        self._cond = threading.Condition()
        self._open: set[tuple[int, int]] = set()
        self._accepting = True
        self.token = relay.open(self)
        """The relay's token: ranks started afterwards connect to its socket on their node."""

    # ------------------------------------------------------------ StreamEnds: the nodes' reader threads

    def opened(self, node: int, stream_id: int) -> bool:
        """Take a new stream (until the group formed)."""
        with self._cond:
            if not self._accepting:
                return False
            self._open.add((node, stream_id))
            return True

    def received(self, node: int, chunks: list[tuple[int, bytes]]) -> None:
        """Queue what streams of ``node`` sent (``b""``: closed), waking ``wait``."""
        with self._cond:
            for stream_id, data in chunks:
                key = (node, stream_id)
                if key not in self._open:
                    continue
                if not data:
                    self._open.discard(key)
                self._arrived.append((key, data))
            self._cond.notify()

    # ------------------------------------------------------------ RankLinks: the kernel's thread

    def wait(self, timeout: float) -> list[tuple[Hashable, bytes]]:
        """Return what the agents relayed since the last call, waiting up to ``timeout`` s for something."""
        with self._cond:
            if not self._arrived:
                self._cond.wait(max(0.0, timeout))
            got = list(self._arrived)
            self._arrived.clear()
        return got

    def send(self, keys: Iterable[Hashable], frame: bytes) -> list[Hashable]:
        """Send ``frame`` to the streams of ``keys``: one message per node; return the closed ones."""
        by_node: dict[int, list[int]] = collections.defaultdict(list)
        failed = []
        with self._cond:
            for key in keys:
                if key in self._open:
                    by_node[key[0]].append(key[1])  # type: ignore[index]
                else:
                    failed.append(key)
        for node, stream_ids in by_node.items():
            if not self._relay.send(node, stream_ids, frame):
                failed += [(node, sid) for sid in stream_ids]
        return failed

    def stop_accepting(self) -> None:
        """Take no new stream (one opened later is closed at once)."""
        with self._cond:
            self._accepting = False

    def close(self, keys: Iterable[Hashable] | None = None) -> None:
        """Close the streams of ``keys`` (None: every one): the ranks see their connection end."""
        with self._cond:
            if keys is None:
                self._accepting = False
                keys = list(self._open)
            keys = [key for key in keys if key in self._open]
            self._open.difference_update(keys)
        for node, stream_id in keys:  # type: ignore[misc]
            self._relay.close_stream(node, stream_id)
