"""The wire between the kernel and its interactive ranks: the messages, their framing, the protocol version.

Each rank holds one Unix-socket connection to the kernel (through a node's relay when it runs on
another machine: the bytes are the same). Both ends import this module, and only this module, to
talk: the rank side (``rank_loop.py``) never imports the kernel side (``group.py``, ``session.py``...),
nor the other way round.

A conversation::

    rank   -> kernel   Ready(version, rank, pid, problem)      once, after forming the process group
    kernel -> rank     Exec | Call | Push | Pull (seq=n)         one command at a time
    rank   -> kernel   Display(seq=n, ...)*                      a display() while the command runs
    rank   -> kernel   Ok | Err | Interrupted (seq=n)            its reply
    kernel closes the connection                                 the rank's loop ends

A message is a frozen dataclass; on the wire it is ``FRAME_HEADER.pack(len(body)) + body``, the body
a pickle of ``(kind, *fields)`` in the order the class declares them. The receiver checks each
message against the types it expects: an unknown kind, a message of the other direction, or one with
another number of fields raises ``ProtocolError`` (never dropped in silence). ``Ready`` carries
``PROTOCOL_VERSION`` as its first field, a place it keeps in every version, and the kernel refuses a
rank that speaks another version with ``ProtocolVersionError`` naming both and the fix.

The rank waits for its next command in :func:`wait_for_command`; :data:`IDLE_WAIT` names that function
(module and name), so the kernel recognises an idle rank in its stacks.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..launch.doctor import Frame
from ..launch.events import FrameDecoder
from ..utils._wire import ConnectionClosed, read_exactly
from ..utils._worker_channel import FRAME_HEADER

__all__ = [
    "COMMANDS",
    "FRAME_HEADER",
    "IDLE_WAIT",
    "MESSAGES",
    "PROTOCOL_VERSION",
    "REPLIES",
    "Call",
    "Command",
    "Display",
    "Err",
    "Exec",
    "Interrupted",
    "Message",
    "MessageReader",
    "Numbered",
    "Ok",
    "ProtocolError",
    "ProtocolVersionError",
    "Pull",
    "Push",
    "Ready",
    "Reply",
    "StackMark",
    "encode",
    "receive",
    "send",
    "wait_for_command",
]

PROTOCOL_VERSION = 1
"""Raised whenever a message changes (a field added, removed or reordered, a kind added or dropped)."""


class ProtocolError(RuntimeError):
    """A peer sent what the kernel <-> rank protocol does not allow here: an unknown or unexpected message."""


class ProtocolVersionError(ProtocolError):
    """A rank speaks another version of the protocol than the kernel (another notebook_accel installation)."""


class Message:
    """A message of the kernel <-> rank wire (each kind is a frozen dataclass below)."""

    __slots__ = ()
    KIND: ClassVar[str]


# ----------------------------------------------------------------------------- rank -> kernel, once


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Message):
    """The rank formed the process group (or could not: ``problem``) and waits for commands."""

    KIND: ClassVar[str] = "ready"
    version: int = PROTOCOL_VERSION
    """The rank's ``PROTOCOL_VERSION``; always the first field, so every version can read it."""
    rank: int
    pid: int
    problem: str | None = None
    """Why the rank could not join the process group (its traceback), or None."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Numbered(Message):
    """A command, or a message about one: ``seq`` is the command's sequence number."""

    seq: int = 0
    """A command is built with 0; ``Group.exchange`` stamps each with its own number, replies carry it."""


# ----------------------------------------------------------------------------- kernel -> rank: commands


@dataclass(frozen=True, slots=True, kw_only=True)
class Exec(Numbered):
    """Run a cell in the rank's namespace; the reply's payload describes its last expression's value."""

    KIND: ClassVar[str] = "exec"
    source: str
    """The cell as written (tracebacks and stacks show it)."""
    filename: str
    python: str | None = None
    """The cell as IPython transformed it (``%time``, ``!ls``), run instead of ``source``; None: as written."""
    ipython: bool = False
    """Run it in the rank's IPython shell (the cell used IPython's syntax)."""
    limit: int | None = None
    """Bytes (pickled) up to which the value itself comes back (None: no limit)."""
    compare: bool = False
    """Send a digest of the value, so ranks' values can be compared without moving them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Call(Numbered):
    """Call a function from the kernel in the rank's namespace: ``blob`` is ``(function, args, kwargs)`` pickled."""

    KIND: ClassVar[str] = "call"
    blob: bytes
    check: dict[str, Any]
    """The kernel's fingerprint of each global the function reads (``stale.global_tokens``)."""
    forked: bool = False
    """The ranks were forked from the kernel (their namespaces started as copies of its ``__main__``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Push(Numbered):
    """Set names in the rank's namespace: ``blob`` is a pickled ``{name: value}``."""

    KIND: ClassVar[str] = "push"
    blob: bytes
    tokens: dict[str, Any]
    """The kernel's fingerprint of each value pushed (``stale.fingerprint``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull(Numbered):
    """Send back the value of ``name`` in the rank's namespace."""

    KIND: ClassVar[str] = "pull"
    name: str
    """A Python name (checked by the kernel before it sends the command)."""


# ----------------------------------------------------------------------------- rank -> kernel: replies


@dataclass(frozen=True, slots=True, kw_only=True)
class Ok(Numbered):
    """The command ran; ``payload`` is ``values.value_payload``'s description of its value."""

    KIND: ClassVar[str] = "ok"
    payload: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Err(Numbered):
    """The command raised on the rank (the rank is alive, its namespace intact)."""

    KIND: ClassVar[str] = "err"
    exc_type: str
    """The exception's type, qualified unless a builtin or defined in ``__main__``."""
    message: str
    traceback: str
    """From the user's first frame on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Interrupted(Numbered):
    """A KeyboardInterrupt ended the command (the kernel's SIGINT, or the code raised it)."""

    KIND: ClassVar[str] = "interrupted"
    traceback: str
    """Where the command was when the KeyboardInterrupt came, from the user's first frame on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Display(Numbered):
    """A ``display()`` of the running command (``seq``), for its cell: a MIME bundle and its metadata."""

    KIND: ClassVar[str] = "display"
    data: dict[str, Any]
    """The MIME bundle: ``{"text/plain": ..., "image/png": ...}``."""
    metadata: dict[str, Any]


Command = Exec | Call | Push | Pull
Reply = Ok | Err | Interrupted
COMMANDS: tuple[type[Message], ...] = (Exec, Call, Push, Pull)
"""What the kernel sends to a rank."""
REPLIES: tuple[type[Message], ...] = (Ok, Err, Interrupted, Display)
"""What a rank sends while and after a command runs."""
MESSAGES: dict[str, type[Message]] = {cls.KIND: cls for cls in (Ready, *COMMANDS, *REPLIES)}
"""Every message kind of this protocol version, by its wire name."""
_FIELDS: dict[type[Message], tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in MESSAGES.values()
}


# ----------------------------------------------------------------------------- framing


def encode(message: Message) -> bytes:
    """Return ``message`` as one frame (header and body), ready for ``sendall`` to any number of ranks."""
    values = tuple(getattr(message, name) for name in _FIELDS[type(message)])
    body = pickle.dumps((message.KIND, *values), protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: Message) -> None:
    """Send one message (blocking)."""
    sock.sendall(encode(message))


def decode(item: object, expected: tuple[type[Message], ...]) -> Message:
    """Return the message ``item`` (an unpickled frame body) holds; ProtocolError unless it is one of ``expected``."""
    if not (isinstance(item, tuple) and item and isinstance(item[0], str)):
        raise ProtocolError(f"not a message of the kernel<->rank protocol: {_short(item)}")
    kind, values = item[0], item[1:]
    cls = MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(
            f"unknown message type {kind!r}: protocol version {PROTOCOL_VERSION} has {', '.join(MESSAGES)}; "
            "the peer runs another notebook_accel (install the same version on both sides)"
        )
    if cls is Ready and values and values[0] != PROTOCOL_VERSION:
        rank = values[1] if len(values) > 1 else "?"
        raise ProtocolVersionError(
            f"rank {rank} speaks version {values[0]!r} of the kernel<->rank protocol and this kernel speaks "
            f"version {PROTOCOL_VERSION}: the rank runs another notebook_accel installation than the kernel. "
            "Install the same notebook_accel version where the ranks run (Nodes(python=...) points at an "
            "environment), then start the ranks again"
        )
    names = _FIELDS[cls]
    if len(values) != len(names):
        raise ProtocolError(
            f"a {kind!r} message came with {len(values)} field(s); protocol version {PROTOCOL_VERSION} gives it "
            f"{len(names)} ({', '.join(names)})"
        )
    if cls not in expected:
        raise ProtocolError(
            f"a {kind!r} message is not expected here (expected {', '.join(c.KIND for c in expected)})"
        )
    return cls(**dict(zip(names, values)))


def receive(sock: socket.socket, expected: tuple[type[Message], ...]) -> Message | None:
    """Return the next message (blocking; one of ``expected``), or None once the peer closed the connection."""
    try:
        (length,) = FRAME_HEADER.unpack(read_exactly(sock, FRAME_HEADER.size))
        body = read_exactly(sock, length)
    except ConnectionClosed:
        return None  # between frames or within one: the peer is gone either way
    return decode(pickle.loads(body), expected)


def wait_for_command(sock: socket.socket) -> Command | None:
    """Return the kernel's next command, or None once the kernel closed the connection: a rank's idle wait.

    A rank whose stack holds this function waits for work (``IDLE_WAIT``).
    """
    return receive(sock, COMMANDS)  # type: ignore[return-value]  # one of COMMANDS, checked by decode


class MessageReader:
    """The kernel's incremental reader of one rank's non-blocking socket: bytes in, checked messages out."""

    def __init__(self, expected: tuple[type[Message], ...] = REPLIES) -> None:
        self._frames = FrameDecoder()
        self.expected = expected

    def feed(self, data: bytes) -> list[Message]:
        """Return every message completed by ``data`` (ProtocolError for one the protocol does not allow)."""
        return [decode(item, self.expected) for item in self._frames.feed(data)]

    @property
    def pending(self) -> int:
        """Return how many bytes of an unfinished frame are buffered."""
        return self._frames.pending


def _short(item: object, limit: int = 80) -> str:
    text = repr(item)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ----------------------------------------------------------------------------- recognising an idle rank


@dataclass(frozen=True)
class StackMark:
    """A function named by its module and name, found in a stack by the file the module lives in."""

    module: str
    function: str

    def in_frames(self, frames: Iterable[Frame]) -> bool:
        """Return True when one of ``frames`` runs this function."""
        suffix = os.sep + self.module.replace(".", os.sep) + ".py"
        return any(f.function == self.function and f.filename.endswith(suffix) for f in frames)


IDLE_WAIT = StackMark(__name__, wait_for_command.__name__)
"""Where a rank waits for its next command: a rank whose main stack holds it is idle."""
