"""Unix-socket connections of remote ranks, carried to the kernel over the agents' channels.

The interactive ranks reach the kernel through a byte stream each (``rank_main(address, ...)``). A
rank on another node connects to a Unix socket of its own node instead: ``NodeGroup.relay.open(ends)``
has every agent listen on one and returns a token; a rank started afterwards finds that socket's
path with ``relay_address(token)`` (the agent puts it in the rank's environment). Each connection
made there becomes a stream: the agent announces it (``OpenStream``), relays what the rank writes
(``FromStreams``: every stream's bytes of one round in one message) and copies what the kernel
sends (``ToStreams``: the same bytes to several streams, in one message) until either side closes
(``CloseStream``). On the kernel's side nothing is kept per stream but its number: the bytes go to
``ends`` (a ``StreamEnds``, the interactive group's ``RelayedLinks``), called on the nodes' reader
threads (``reader.ChannelReader``, one per 16 nodes).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from abc import ABC, abstractmethod
from typing import Any

from . import protocol as wire
from .protocol import RELAY_ENV_PREFIX

__all__ = ["StreamEnds", "StreamRelay", "relay_address"]

logger = logging.getLogger(__name__)
_LISTEN_SECONDS = 10.0


class StreamEnds(ABC):
    """The kernel's end of one relay's streams.

    Called on the nodes' reader threads, a node's streams always on the same one (return quickly).
    """

    @abstractmethod
    def opened(self, node: int, stream_id: int) -> bool:
        """A rank of node ``node`` connected: stream ``stream_id``; return False to refuse (it is closed)."""

    @abstractmethod
    def received(self, node: int, chunks: list[tuple[int, bytes]]) -> None:
        """Bytes of streams of ``node``, in order per stream; ``b""``: that stream closed (or its node was lost)."""


def relay_address(token: str) -> str:
    """Return, in a rank on a node, the Unix socket path of relay ``token``; KeyError naming it where there is none."""
    try:
        return os.environ[RELAY_ENV_PREFIX + token]
    except KeyError:
        raise KeyError(
            f"no relay {token!r} in this process: it is set for ranks started by a node's agent after "
            "NodeGroup.relay.open() returned that token"
        ) from None


class StreamRelay:
    """The kernel's end of the relays of one ``NodeGroup``: which streams are open, and to whom they go."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._ends: dict[str, StreamEnds] = {}  # token -> the kernel's end of its streams
        self._listening: dict[str, dict[int, str]] = {}  # token -> {node index: path there}
        self._ready = threading.Condition()
        self._streams: dict[tuple[int, int], StreamEnds] = {}  # (node index, stream id) -> its end
        self._lock = threading.Lock()
        self._closed = False

    def open(self, ends: StreamEnds) -> str:
        """Return the token of a new relay: connections to it on any node become streams of ``ends``."""
        token = uuid.uuid4().hex[:16]
        self._ends[token] = ends
        self._listening[token] = {}
        nodes = [node for node in self._group.nodes if node.lost is None]
        for node in nodes:
            node.send_quietly(wire.Listen(token))
        with self._ready:
            if not self._ready.wait_for(lambda: len(self._listening[token]) == len(nodes), _LISTEN_SECONDS):
                missing = [n.host for n in nodes if n.index not in self._listening[token]]
                raise TimeoutError(
                    f"node(s) {missing} did not open a relay socket within {_LISTEN_SECONDS:g} s"
                )
        return token

    def open_streams(self) -> int:
        """Return how many streams are open."""
        return len(self._streams)

    def send(self, node_index: int, stream_ids: list[int], data: bytes) -> bool:
        """Send ``data`` to each of ``stream_ids`` of node ``node_index`` (one message); False when the node is lost."""
        node = self._group.nodes[node_index]
        if node.lost is not None:
            return False
        node.send_quietly(wire.ToStreams(stream_ids, data))
        return node.lost is None

    def close_stream(self, node_index: int, stream_id: int) -> None:
        """Close stream ``stream_id`` of node ``node_index`` (the rank sees its connection end)."""
        with self._lock:
            ends = self._streams.pop((node_index, stream_id), None)
        if ends is not None:
            self._group.nodes[node_index].send_quietly(wire.CloseStream(stream_id))

    def on_message(self, node: Any, message: wire.Message) -> None:
        """Handle one relay message of ``node``'s agent (called on a reader thread of the nodes)."""
        if isinstance(message, wire.Listening):
            with self._ready:
                self._listening.setdefault(message.token, {})[node.index] = message.path
                self._ready.notify_all()
        elif isinstance(message, wire.OpenStream):
            self._open(node, message.token, message.stream_id)
        elif isinstance(message, wire.FromStreams):
            self._received(node.index, message.chunks)
        elif isinstance(message, wire.CloseStream):
            self._received(node.index, [(message.stream_id, b"")])

    def _open(self, node: Any, token: str, stream_id: int) -> None:
        ends = self._ends.get(token)
        with self._lock:
            taken = ends is not None and not self._closed and ends.opened(node.index, stream_id)
            if taken:
                self._streams[(node.index, stream_id)] = ends
        if not taken:
            logger.warning("relay %s: stream %d of node %s refused", token, stream_id, node.host)
            node.send_quietly(wire.CloseStream(stream_id))

    def _received(self, node_index: int, chunks: list[tuple[int, bytes]]) -> None:
        by_ends: dict[int, tuple[StreamEnds, list[tuple[int, bytes]]]] = {}
        with self._lock:
            for stream_id, data in chunks:
                ends = self._streams.get((node_index, stream_id))
                if ends is None:
                    continue
                if not data:
                    del self._streams[(node_index, stream_id)]
                by_ends.setdefault(id(ends), (ends, []))[1].append((stream_id, data))
        for ends, mine in by_ends.values():
            ends.received(node_index, mine)

    def node_lost(self, node: Any) -> None:
        """End the streams of a lost node (their ends see them close)."""
        ids = [stream_id for index, stream_id in list(self._streams) if index == node.index]
        self._received(node.index, [(stream_id, b"") for stream_id in ids])

    def close(self) -> None:
        """Close every stream (their ends see them close)."""
        with self._lock:
            self._closed = True
        for node in self._group.nodes:
            self.node_lost(node)
