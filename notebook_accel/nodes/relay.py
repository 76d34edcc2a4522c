"""Unix-socket connections of remote ranks, carried to a listener of the kernel over the agents' channels.

The interactive ranks reach the kernel through a Unix socket (``rank_main(address, ...)``). A rank
on another node cannot: ``NodeGroup.relay.relay_unix(path)`` has every agent listen on a Unix
socket of its own node and returns a token; a rank started afterwards finds that socket's path
with ``relay_address(token)`` (the agent puts it in the rank's environment). Each connection made
there becomes a stream: the agent announces it (``open_stream``), the kernel side connects to
``path`` and both ends copy bytes (``stream``) until either closes (``close_stream``).
"""

from __future__ import annotations

import logging
import os
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
            self._streams[(node.index, stream_id)] = conn
        threading.Thread(
            target=self._pump,
            args=(node, stream_id, conn),
            name=f"notebook_accel-relay-{stream_id}",
            daemon=True,
        ).start()

    def _pump(self, node: Any, stream_id: int, conn: socket.socket) -> None:
        """Copy what the kernel's side of one stream writes to the agent, until it closes."""
        while True:
            try:
                chunk = conn.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self._close(node, stream_id, tell=True)
                return
            node.send_quietly(wire.StreamData(stream_id, chunk))

    def _close(self, node: Any, stream_id: int, tell: bool) -> None:
        with self._lock:
            conn = self._streams.pop((node.index, stream_id), None)
        if conn is None:
            return
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
