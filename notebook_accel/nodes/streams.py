"""Byte streams relayed over a node's channel: how interactive ranks on another machine reach the kernel.

Interactive ranks talk to the kernel over a Unix socket (``interactive.rank_loop``). A rank on another
node cannot reach the kernel's socket, so its node's agent listens on a private Unix socket there
(:class:`AgentStreams`; its path is given to the ranks in ``NOTEBOOK_ACCEL_RELAY_SOCKET``) and turns each
connection into a stream of channel messages; the kernel side (:class:`KernelStreams`) connects each
stream to the kernel's real listener. The rank's first bytes are a header naming that listener
(:func:`pack_target`), and the kernel only connects to an interactive ranks' socket
(:func:`check_target`), never to another socket of the machine.

The messages, one per call of ``send`` (the channel signs and carries them):
``("open_stream", sid)``, ``("stream_data", sid, bytes)``, ``("close_stream", sid)``. Stream ids are
the agent's; each agent connection has its own :class:`KernelStreams`.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
from collections.abc import Callable

__all__ = ["FOLDER_PREFIX", "AgentStreams", "KernelStreams", "check_target", "pack_target", "read_target"]

logger = logging.getLogger(__name__)

FOLDER_PREFIX = "notebook_accel-ranks-"
"""The private folder (``tempfile.mkdtemp``, mode 0700) holding the kernel's listener of interactive ranks."""

_HEADER = struct.Struct(">I")
_MAX_TARGET = 4096  # bytes of a path (PATH_MAX): a longer header is not one a rank wrote
_CHUNK = 1 << 16

Send = Callable[[tuple], None]


def pack_target(path: str) -> bytes:
    """Return the header a relayed stream starts with: the kernel-side socket path, length-prefixed."""
    target = os.fsencode(path)
    return _HEADER.pack(len(target)) + target


def read_target(data: bytes) -> tuple[str, bytes] | None:
    """Return ``(target path, the bytes after the header)`` once ``data`` holds the whole header, else None.

    Raises ValueError for a header no rank writes (an empty path or one longer than PATH_MAX).
    """
    if len(data) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack_from(data)
    if size == 0 or size > _MAX_TARGET:
        raise ValueError(f"a relayed stream's header names a {size}-byte path; expected 1..{_MAX_TARGET}")
    end = _HEADER.size + size
    if len(data) < end:
        return None
    return os.fsdecode(data[_HEADER.size : end]), data[end:]


def check_target(path: str) -> str:
    """Return ``path`` resolved when it is the socket of interactive ranks on this machine, else raise PermissionError.

    Such a socket lies in a ``notebook_accel-ranks-*`` folder of this user's temporary directory that
    only this user may enter (what ``start_ranks`` makes); a relayed stream may reach nothing else.
    """
    real = os.path.realpath(path)
    folder = os.path.dirname(real)
    root = os.path.realpath(tempfile.gettempdir())
    try:
        info, folder_info = os.stat(real), os.stat(folder)
    except OSError as exc:
        raise PermissionError(f"relayed stream to {path!r} refused: {exc.strerror}") from None
    ours = (
        os.path.dirname(folder) == root
        and os.path.basename(folder).startswith(FOLDER_PREFIX)
        and stat.S_ISSOCK(info.st_mode)
        and folder_info.st_uid == os.getuid()
        and stat.S_IMODE(folder_info.st_mode) & 0o077 == 0
    )
    if not ours:
        raise PermissionError(
            f"relayed stream to {path!r} refused: only the socket of interactive ranks "
            f"({root}/{FOLDER_PREFIX}*/...) may be reached through a node's agent"
        )
    return real


class _Streams:
    """Local sockets pumped to and from the channel: a reader thread per socket, writes from ``handle``."""

    def __init__(self, send: Send, name: str) -> None:
        self._send = send
        self._name = name
        self._lock = threading.Lock()
        self._socks: dict[int, socket.socket] = {}
        self._closed = False

    def _attach(self, sid: int, sock: socket.socket) -> None:
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._socks[sid] = sock
        threading.Thread(target=self._pump, args=(sid, sock), name=f"{self._name}-{sid}", daemon=True).start()

    def _pump(self, sid: int, sock: socket.socket) -> None:
        """Send what the local socket gives as ``stream_data``, then ``close_stream`` at its end."""
        try:
            while chunk := sock.recv(_CHUNK):
                self._send(("stream_data", sid, chunk))
        except OSError:
            pass  # closed here (close_stream from the other side, or close())
        finally:
            if self._drop(sid) is not None:
                self._tell_closed(sid)

    def _tell_closed(self, sid: int) -> None:
        try:
            self._send(("close_stream", sid))
        except Exception:  # the channel is gone: the other side closes every stream with it
            logger.debug("close_stream %d not sent", sid, exc_info=True)

    def _drop(self, sid: int) -> socket.socket | None:
        with self._lock:
            sock = self._socks.pop(sid, None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        return sock

    def _write(self, sid: int, data: bytes) -> None:
        with self._lock:
            sock = self._socks.get(sid)
        if sock is None:
            return  # closed here meanwhile; our close_stream is on its way
        try:
            sock.sendall(data)
        except OSError:
            if self._drop(sid) is not None:
                self._tell_closed(sid)

    def handle(self, message: tuple) -> None:
        """Act on one stream message from the other side (``stream_data`` / ``close_stream``)."""
        kind, sid = message[0], message[1]
        if kind == "stream_data":
            self._write(sid, message[2])
        elif kind == "close_stream":
            self._drop(sid)
        else:
            raise ValueError(f"not a stream message: {kind!r}")

    def close(self) -> None:
        """Close every stream (the channel ended): each rank sees its connection to the kernel end."""
        with self._lock:
            self._closed = True
            sids = list(self._socks)
        for sid in sids:
            self._drop(sid)


class AgentStreams(_Streams):
    """The node's end: a private Unix listener whose every connection becomes a stream to the kernel.

    ``path`` is what the node's ranks get in ``NOTEBOOK_ACCEL_RELAY_SOCKET``.
    """

    def __init__(self, send: Send) -> None:
        super().__init__(send, "notebook_accel-agent-stream")
        self._folder = tempfile.mkdtemp(prefix="notebook_accel-relay-")  # 0700: only this user connects
        self.path = os.path.join(self._folder, "relay.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._next = 0
        self._acceptor = threading.Thread(target=self._accept, name="notebook_accel-agent-relay", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()[0]
            except OSError:
                return  # closed
            self._next += 1
            sid = self._next
            try:
                self._send(("open_stream", sid))
            except Exception:
                conn.close()
                logger.debug("open_stream %d not sent", sid, exc_info=True)
                continue
            self._attach(sid, conn)

    def close(self) -> None:
        """Stop listening, close every stream and remove the listener's folder."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        super().close()
        shutil.rmtree(self._folder, ignore_errors=True)


class KernelStreams(_Streams):
    """The kernel's end of one agent's streams: each one connected to the interactive ranks' socket it names."""

    def __init__(self, send: Send) -> None:
        super().__init__(send, "notebook_accel-kernel-stream")
        self._pending: dict[int, bytes] = {}

    def handle(self, message: tuple) -> None:
        """Act on ``open_stream`` / ``stream_data`` / ``close_stream`` from the agent."""
        kind, sid = message[0], message[1]
        if kind == "open_stream":
            self._pending[sid] = b""
        elif kind == "stream_data" and sid in self._pending:
            self._connect(sid, self._pending.pop(sid) + message[2])
        elif kind == "close_stream" and sid in self._pending:
            del self._pending[sid]
        else:
            super().handle(message)

    def _connect(self, sid: int, data: bytes) -> None:
        """Connect stream ``sid`` once its header arrived; refuse (close the stream) if it names a foreign socket."""
        try:
            parsed = read_target(data)
            if parsed is None:
                self._pending[sid] = data
                return
            path, rest = parsed
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(check_target(path))
                if rest:
                    sock.sendall(rest)
            except BaseException:
                sock.close()
                raise
        except (OSError, ValueError) as exc:  # PermissionError is an OSError
            logger.warning("a relayed stream from a node was refused: %s", exc)
            self._tell_closed(sid)
            return
        self._attach(sid, sock)

    def close(self) -> None:
        """Close every stream and forget the ones still waiting for their header."""
        self._pending.clear()
        super().close()
