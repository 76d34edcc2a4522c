"""The authenticated channel between the kernel and a node's agent: nothing is unpickled before both sides proved the secret.

Each launch draws a fresh 32-byte secret (``new_secret``); the agent gets it on its stdin (the
bootstrap line), never on a command line. A connection starts with a challenge-response of raw
bytes both ways (no pickle involved):

    kernel -> agent   MAGIC + nonce_k (32 bytes)
    agent  -> kernel  nonce_a + HMAC(secret, "agent" | nonce_k | nonce_a)
    kernel -> agent   HMAC(secret, "kernel" | nonce_a | nonce_k)

Each side checks the other's proof with ``hmac.compare_digest`` and closes the connection on a
wrong one. Both then derive one key per direction from the secret and both nonces, so a frame of
another connection or of the other direction never verifies. Every frame afterwards is
``length (4 bytes) | HMAC-SHA256(key, sequence (8 bytes) | body) | body``: the receiver counts
the sequence itself, so a replayed, reordered, dropped or altered frame fails the check; then
``ChannelError`` is raised, the connection is closed, and the body is never unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
import socket
import struct
import threading
from collections import deque
from typing import Any

from ..utils._wire import ConnectionClosed, read_exactly, unread_bytes

__all__ = ["MAX_FRAME", "Channel", "ChannelError", "accept_channel", "connect_channel", "new_secret"]

MAGIC = b"notebook_accel-nodes/1\n"
SECRET_BYTES = 32
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_HEADER = struct.Struct(">I")
_SEQUENCE = struct.Struct(">Q")
MAX_FRAME = 1 << 30
"""Largest frame body accepted (1 GiB): a length beyond it is refused before anything is read."""
_RECV = 1 << 16  # what one read asks for: the frames that came meanwhile, in one system call
_HEAD = _HEADER.size + _MAC  # what precedes each body


class ChannelError(ConnectionError):
    """The peer failed authentication, sent a frame whose signature does not verify, or went away."""


def new_secret() -> bytes:
    """Return a fresh per-launch secret (32 random bytes)."""
    return secrets.token_bytes(SECRET_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class _FrameSigner:
    """HMAC-SHA256 under one key (RFC 2104), with the key's two padded blocks hashed once, not per frame.

    ``sign(sequence, body)`` equals ``hmac.new(key, sequence + body, sha256).digest()`` and costs two
    copies of a hash state: a third of ``hmac.new``'s time for a small frame (heartbeats, replies).
    """

    __slots__ = ("_inner", "_outer")
    _BLOCK = hashlib.sha256().block_size

    def __init__(self, key: bytes) -> None:
        if len(key) > self._BLOCK:
            key = hashlib.sha256(key).digest()
        block = key.ljust(self._BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def sign(self, sequence: bytes, body: bytes) -> bytes:
        """Return the MAC of ``sequence | body``."""
        inner = self._inner.copy()
        inner.update(sequence)
        inner.update(body)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class Channel:
    """One authenticated connection: ``send(obj)`` signs and writes a pickle; ``recv()`` verifies, then unpickles."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # a frame is one write: it leaves at once, never
            # held by Nagle's algorithm until the peer's delayed ACK (40 ms on Linux) acknowledges the one before
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_key, self._recv_key = send_key, recv_key
        self._signer, self._checker = _FrameSigner(send_key), _FrameSigner(recv_key)
        self._send_seq = self._recv_seq = 0
        self._received = bytearray()  # bytes read past the last frame returned (one reader at a time)
        self._large: bytearray | None = None  # a frame over one read, being read into place (read_ready)
        self._large_have = 0
        self._ready: deque[bytes] = deque()  # frames recv_bytes read past the one it returned
        self._failure: ChannelError | None = None  # what ended the connection, once recv_bytes met it
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, message: Any) -> None:
        """Sign and send ``message`` (any picklable object); ChannelError when the connection is gone."""
        self.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, body: bytes) -> None:
        """Sign and send one frame holding ``body``."""
        with self._send_lock:
            mac = self._signer.sign(_SEQUENCE.pack(self._send_seq), body)
            self._send_seq += 1
            try:
                self.sock.sendall(_HEADER.pack(len(body)) + mac + body)
            except OSError as exc:
                self.close()
                raise ChannelError(f"sending failed: {exc}") from exc

    def recv(self) -> Any:
        """Return the next message, unpickled only after its signature verified; ChannelError otherwise."""
        return pickle.loads(self.recv_bytes())

    def recv_bytes(self) -> bytes:
        """Return the next frame's body once its signature verified (the connection is dropped if not).

        Blocks until a frame is complete: the same reads as ``read_ready``, repeated, so one read often
        brings several frames, kept here in order for the next calls.
        """
        while not self._ready:
            if self._failure is not None:
                raise self._failure
            bodies, self._failure = self.read_ready()
            self._ready.extend(bodies)
        return self._ready.popleft()

    def read_ready(self) -> tuple[list[bytes], ChannelError | None]:
        """Read once what has come (for a selector's reader: the socket is readable, so this never blocks).

        Return the bodies of the frames it completed, verified, in order, and the error that ended the
        connection meanwhile (it closed, or a frame failed its check: the channel is closed then, and
        the frames after the bad one are never unpickled), else None. A frame still on its way stays
        buffered for the next call; one larger than a read is read straight into place.
        """
        bodies: list[bytes] = []
        try:
            if self._large is not None or self._missing() > _RECV:
                self._read_large()
            else:
                chunk = self.sock.recv(_RECV)
                if not chunk:
                    raise ConnectionClosed(len(self._received), len(self._received) + self._missing())
                self._received += chunk
            self._cut_frames(bodies)
        except ChannelError as exc:
            self.close()
            return bodies, exc
        except OSError as exc:
            self.close()
            return bodies, ChannelError(f"receiving failed: {exc}")
        return bodies, None

    def _missing(self) -> int:
        """Return how many bytes the frame begun in the buffer still lacks (its header's, when that is short)."""
        have = len(self._received)
        if have < _HEAD:
            return _HEAD - have
        (length,) = _HEADER.unpack_from(self._received)
        _check_length(length)
        return max(0, _HEAD + length - have)

    def _read_large(self) -> None:
        """Read into the large frame under way (started with what the buffer holds of it)."""
        if self._large is None:
            self._large = bytearray(len(self._received) + self._missing())
            self._large[: len(self._received)] = self._received
            self._large_have = len(self._received)
            self._received.clear()
        with memoryview(self._large) as view:
            got = self.sock.recv_into(view[self._large_have :])
        if not got:
            raise ConnectionClosed(self._large_have, len(self._large))
        self._large_have += got
        if self._large_have == len(self._large):  # complete: it goes through the buffer as any frame
            self._received, self._large = self._large, None

    def _cut_frames(self, bodies: list[bytes]) -> None:
        """Move every complete frame of the buffer, verified, into ``bodies``."""
        buffer = self._received
        while len(buffer) >= _HEAD:
            (length,) = _HEADER.unpack_from(buffer)
            _check_length(length)
            end = _HEAD + length
            if len(buffer) < end:
                return
            with memoryview(buffer) as view:  # one copy of the body, not two
                mac, body = bytes(view[_HEADER.size : _HEAD]), bytes(view[_HEAD:end])
            del buffer[:end]  # O(1) at a bytearray's front
            bodies.append(self._verified(mac, body))

    def _verified(self, mac: bytes, body: bytes) -> bytes:
        """Return ``body`` if ``mac`` signs it as the next frame; else close and raise ChannelError."""
        expected = self._checker.sign(_SEQUENCE.pack(self._recv_seq), body)
        if not hmac.compare_digest(mac, expected):
            self.close()
            raise ChannelError(
                f"frame {self._recv_seq} failed its signature check (tampered, replayed or out of order); "
                "the connection was dropped"
            )
        self._recv_seq += 1
        return body

    def unread(self) -> int:
        """Return how many bytes of the peer's wait here: in the socket, or whole frames read ahead (0 once closed).

        A peer whose bytes wait here is not silent: this side is behind in reading them. The start of a
        frame already read, its rest not come, is not counted: that is the peer's silence.
        """
        if self.closed:
            return 0
        return sum(len(body) for body in list(self._ready)) + unread_bytes(self.sock.fileno())

    def close(self) -> None:
        """Close the connection (idempotent); a reader blocked in ``recv`` gets ChannelError."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _check_length(length: int) -> None:
    if length > MAX_FRAME:
        raise ChannelError(f"a frame of {length} bytes is over the limit of {MAX_FRAME}")


def _keys(secret: bytes, nonce_k: bytes, nonce_a: bytes) -> tuple[bytes, bytes]:
    """Return (kernel-to-agent key, agent-to-kernel key) of one connection."""
    return _mac(secret, b"k2a", nonce_k, nonce_a), _mac(secret, b"a2k", nonce_k, nonce_a)


def accept_channel(sock: socket.socket, secret: bytes, timeout: float = 10.0) -> Channel:
    """Return the channel over ``sock`` (accepted by the kernel) once the agent proved the secret.

    Raises ChannelError (and closes ``sock``) when it does not within ``timeout`` seconds.
    """
    try:
        sock.settimeout(timeout)
        nonce_k = secrets.token_bytes(_NONCE)
        sock.sendall(MAGIC + nonce_k)
        answer = read_exactly(sock, _NONCE + _MAC)
        nonce_a, proof = answer[:_NONCE], answer[_NONCE:]
        if not hmac.compare_digest(proof, _mac(secret, b"agent", nonce_k, nonce_a)):
            raise ChannelError("the peer did not prove the launch's secret; connection refused")
        sock.sendall(_mac(secret, b"kernel", nonce_a, nonce_k))
        sock.settimeout(None)
    except (OSError, ChannelError) as exc:
        sock.close()
        raise exc if isinstance(exc, ChannelError) else ChannelError(f"handshake failed: {exc}") from exc
    to_agent, to_kernel = _keys(secret, nonce_k, nonce_a)
    return Channel(sock, send_key=to_agent, recv_key=to_kernel)


def connect_channel(address: tuple[str, int], secret: bytes, timeout: float = 10.0) -> Channel:
    """Return the agent's channel to the kernel at ``address`` once both sides proved the secret."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        hello = read_exactly(sock, len(MAGIC) + _NONCE)
        if not hmac.compare_digest(hello[: len(MAGIC)], MAGIC):
            raise ChannelError(f"{address[0]}:{address[1]} is not a notebook_accel kernel")
        nonce_k = hello[len(MAGIC) :]
        nonce_a = secrets.token_bytes(_NONCE)
        sock.sendall(nonce_a + _mac(secret, b"agent", nonce_k, nonce_a))
        proof = read_exactly(sock, _MAC)
        if not hmac.compare_digest(proof, _mac(secret, b"kernel", nonce_a, nonce_k)):
            raise ChannelError("the kernel did not prove the launch's secret; connection refused")
        sock.settimeout(None)
    except (OSError, ChannelError) as exc:
        sock.close()
        raise exc if isinstance(exc, ChannelError) else ChannelError(f"handshake failed: {exc}") from exc
    to_agent, to_kernel = _keys(secret, nonce_k, nonce_a)
    return Channel(sock, send_key=to_kernel, recv_key=to_agent)
