"""What every wire between our processes needs: reading exactly n bytes, and pickling by value for the other side.

The kernel <-> interactive rank socket (``interactive/protocol.py``), the kernel <-> node agent channel
(``nodes/channel.py``) and the launcher starting a fresh interpreter (``launch/procs.py``) use these
two helpers, so a short read and an unpicklable value mean the same thing, and say the same, on every
wire. Standard library and cloudpickle only: the rank side, ``launch/`` and ``nodes/`` all import it.
"""

from __future__ import annotations

import fcntl
import io
import os
import pickle
import socket
import struct
import tempfile
import termios
from collections.abc import Callable
from typing import Any

import cloudpickle

__all__ = [
    "UNIX_PATH_MAX",
    "ConnectionClosed",
    "dumps_by_value",
    "read_exactly",
    "unread_bytes",
    "unix_socket_path",
]

_CHUNK = 1 << 20  # one recv at most: a big frame is read in pieces, never asked of the kernel at once
UNIX_PATH_MAX = 107
"""Longest Unix socket path Linux binds (``sun_path`` is 108 bytes with its final NUL)."""
_SHORT_BASE = "/tmp"  # where a socket goes when $TMPDIR's path is too long for one


def unix_socket_path(prefix: str, name: str = "s") -> str:
    """Return ``<new private directory>/<name>`` for a Unix socket, short enough to bind.

    The directory is made under the temporary directory (``$TMPDIR``); where that path would be over
    ``UNIX_PATH_MAX`` bytes (a deep ``$TMPDIR``, e.g. in CI or on a cluster's scratch), under ``/tmp``.
    OSError naming ``$TMPDIR`` and the way out when neither works. The caller removes the directory.
    """
    longest = len(prefix) + 8 + len(name) + 2  # mkdtemp adds 8 characters, then two separators
    for base in (tempfile.gettempdir(), _SHORT_BASE):
        if len(os.fsencode(base)) + longest <= UNIX_PATH_MAX and os.access(base, os.W_OK | os.X_OK):
            return os.path.join(tempfile.mkdtemp(prefix=prefix, dir=base), name)
    raise OSError(
        f"no directory to put a Unix socket in: TMPDIR={tempfile.gettempdir()!r} makes its path longer than "
        f"{UNIX_PATH_MAX} bytes, and {_SHORT_BASE} is too long or not writable; set TMPDIR to a shorter "
        "writable directory"
    )


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before ``wanted`` bytes came; ``got`` of them did."""

    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"the connection closed after {got} of {wanted} bytes")
        self.got = got
        self.wanted = wanted


def read_exactly(sock: socket.socket, size: int) -> bytes:
    """Return the next ``size`` bytes of ``sock`` (blocking); ConnectionClosed when the peer closes first."""
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, _CHUNK))
        if not chunk:
            raise ConnectionClosed(got, size)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle's pickler with one more say: ``reduce(obj)`` first (NotImplemented: the usual way)."""

    def __init__(self, file: io.BytesIO, reduce: Callable[[object], Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._reduce = reduce

    def reducer_override(self, obj: object) -> Any:
        reduced = self._reduce(obj)
        return reduced if reduced is not NotImplemented else super().reducer_override(obj)


def dumps_by_value(
    value: object, *, what: str, to: str, fix: str, reduce: Callable[[object], Any] | None = None
) -> bytes:
    """Return ``value`` pickled for another process (cloudpickle: functions and classes of ``__main__`` by value).

    ``reduce(obj)`` may pickle some objects its own way (return a reduce tuple, or NotImplemented).
    A value that cannot be pickled raises TypeError saying ``what`` could not be sent ``to`` where,
    why, and ``fix``; the pickling error is its ``__cause__``.
    """
    try:
        if reduce is None:
            return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        buffer = io.BytesIO()
        _Pickler(buffer, reduce).dump(value)
        return buffer.getvalue()
    except Exception as exc:
        raise TypeError(
            f"{what} cannot be pickled to send to {to} ({type(exc).__name__}: {exc}); {fix}"
        ) from exc


def unread_bytes(fd: int) -> int:
    """Return how many bytes wait unread in the pipe or socket ``fd`` (0 where that cannot be asked)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0
