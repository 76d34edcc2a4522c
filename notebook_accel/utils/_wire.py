"""What every wire between our processes needs: reading exactly n bytes, and pickling by value for the other side.

The kernel <-> interactive rank socket (``interactive/protocol.py``), the kernel <-> node agent channel
(``nodes/channel.py``) and the launcher starting a fresh interpreter (``launch/procs.py``) use these
two helpers, so a short read and an unpicklable value mean the same thing, and say the same, on every
wire. Standard library and cloudpickle only: the rank side, ``launch/`` and ``nodes/`` all import it.
"""

from __future__ import annotations

import io
import pickle
import socket
from collections.abc import Callable
from typing import Any

import cloudpickle

__all__ = ["ConnectionClosed", "dumps_by_value", "read_exactly"]

_CHUNK = 1 << 20  # one recv at most: a big frame is read in pieces, never asked of the kernel at once


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
