"""Unix-socket connections of remote ranks, carried to a listener of the kernel over the agents' channels.

The interactive ranks reach the kernel through a Unix socket (``rank_main(address, ...)``). A rank
on another node cannot: ``NodeGroup.relay.relay_unix(path)`` has every agent listen on a Unix
socket of its own node and returns a token; a rank started afterwards finds that socket's path
with ``relay_address(token)`` (the agent puts it in the rank's environment). Each connection made
there becomes a stream: the agent announces it (``OpenStream``), the kernel side connects to
``path`` and both ends copy bytes (``StreamData``) until either closes (``CloseStream``). On the
kernel's side one thread (one selector) copies every stream's bytes to its agent, however many
ranks there are; what the agents send is written by the node's reader thread.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import uuid
from typing import Any

from . import protocol as wire
from .protocol import RELAY_ENV_PREFIX

__all__ = ["StreamRelay", "relay_address"]

logger = logging.getLogger(__name__)
_LISTEN_SECONDS = 10.0


def relay_address(token: str) -> str:
    """Return, in a rank on a node, the Unix socket path of relay ``token``; KeyError naming it where there is none."""
    try:
        return os.environ[RELAY_ENV_PREFIX + token]
    except KeyError:
        raise KeyError(
            f"no relay {token!r} in this process: it is set for ranks started by a node's agent after "
            "NodeGroup.relay.relay_unix() returned that token"
        ) from None


class StreamRelay:
    """The kernel's end of the relays of one ``NodeGroup``."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._targets: dict[str, str] = {}  # token -> the kernel's Unix socket path
        self._listening: dict[str, dict[int, str]] = {}  # token -> {node index: path there}
        self._ready = threading.Condition()
        self._streams: dict[tuple[int, int], socket.socket] = {}
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._pump: threading.Thread | None = None
        self._closed = False

    def relay_unix(self, path: str) -> str:
        """Return the token of a new relay: connections to it on any node reach the Unix socket ``path`` here."""
        token = uuid.uuid4().hex[:16]
        self._targets[token] = path
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

    def paths(self, token: str) -> dict[int, str]:
        """Return ``{node index: socket path on that node}`` of relay ``token``."""
        return dict(self._listening[token])

    def on_message(self, node: Any, message: wire.Message) -> None:
        """Handle one relay message of ``node``'s agent (called by its reader thread)."""
        if isinstance(message, wire.Listening):
            with self._ready:
                self._listening.setdefault(message.token, {})[node.index] = message.path
                self._ready.notify_all()
        elif isinstance(message, wire.OpenStream):
            self._open(node, message.token, message.stream_id)
        elif isinstance(message, wire.StreamData):
            conn = self._streams.get((node.index, message.stream_id))
            if conn is not None:
                try:
                    conn.sendall(message.data)
                except OSError:
                    self._close(node, message.stream_id, tell=True)
        elif isinstance(message, wire.CloseStream):
            self._close(node, message.stream_id, tell=False)

    def _open(self, node: Any, token: str, stream_id: int) -> None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._targets[token])
        except (OSError, KeyError) as exc:
            logger.warning("relay %s: cannot reach the kernel's socket: %s", token, exc)
            conn.close()
            node.send_quietly(wire.CloseStream(stream_id))
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._streams[(node.index, stream_id)] = conn
            self._sel.register(conn, selectors.EVENT_READ, (node, stream_id))
            if self._pump is None:
                self._pump = threading.Thread(target=self._copy, name="notebook_accel-relay", daemon=True)
                self._pump.start()

    def _copy(self) -> None:
        """Copy what the kernel's side of every stream writes to its agent, until the relay closes."""
        while not self._closed:
            for key, _ in self._sel.select(1.0):
                node, stream_id = key.data
                try:
                    chunk = key.fileobj.recv(1 << 16)
                except OSError:  # closed meanwhile by another thread
                    chunk = b""
                if chunk:
                    node.send_quietly(wire.StreamData(stream_id, chunk))
                else:
                    self._close(node, stream_id, tell=True)
        self._sel.close()

    def _close(self, node: Any, stream_id: int, tell: bool) -> None:
        with self._lock:
            conn = self._streams.pop((node.index, stream_id), None)
            if conn is None:
                return
            self._sel.unregister(conn)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()
        if tell:
            node.send_quietly(wire.CloseStream(stream_id))

    def node_lost(self, node: Any) -> None:
        """Close the streams of a lost node (the kernel's side sees them end)."""
        for _index, stream_id in [key for key in self._streams if key[0] == node.index]:
            self._close(node, stream_id, tell=False)

    def close(self) -> None:
        """Close every stream."""
        for node in self._group.nodes:
            self.node_lost(node)
        with self._lock:
            self._closed = True  # the copying thread ends within a second, and closes the selector
            if self._pump is None:
                self._sel.close()
