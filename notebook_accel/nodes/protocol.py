"""The wire between the kernel and a node's agent: the messages, their encoding, the constants, the version.

Both sides import this module, and only this module, to talk: the kernel side (``remote.py``,
``relay.py``) never imports the agent's entry point (``agent.py``), nor the other way round. Frames
travel over the authenticated ``channel.Channel`` (length, HMAC, body); a body is a pickle of
``(kind, *fields)`` in the order the message's class declares them.

A conversation::

    kernel -> agent    bootstrap line on stdin (JSON, with "protocol": PROTOCOL_VERSION)
    agent  -> kernel   Hello(version, node, versions, info)          once, after the handshake
    kernel -> agent    Start(request, sys_path, ranks)               one per node and launch: every rank of it
    agent  -> kernel   Started(request, pids, failed)                one answer for the whole batch
    agent  -> kernel   Output(chunks) | Eof | Exited | Usage          while the ranks run
    kernel -> agent    Signal | StackRequest | Listen | ToStreams     as the launch needs
    agent  -> kernel   Stacks | Listening | OpenStream | FromStreams
    both               Heartbeat, CloseStream
    kernel -> agent    End                                            the ranks end, the agent exits

``decode`` checks each body against the types its receiver expects: an unknown kind, one of the other
direction, or one with another number of fields raises ``ProtocolError``. ``Hello`` carries
``PROTOCOL_VERSION`` first (a place it keeps in every version) and the kernel refuses an agent that
speaks another with ``ProtocolVersionError`` naming both; the agent checks the bootstrap's version
the same way before it connects.
"""

from __future__ import annotations

import importlib.metadata
import pickle
import platform
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .channel import Channel

__all__ = [
    "DEFAULT_HEARTBEAT",
    "LOST_AFTER",
    "OWN_BEAT_AFTER",
    "PROTOCOL_VERSION",
    "RELAY_ENV_PREFIX",
    "TO_AGENT",
    "TO_KERNEL",
    "USAGE_REFRESH",
    "Chunk",
    "CloseStream",
    "End",
    "Eof",
    "Exited",
    "FromStreams",
    "Heartbeat",
    "Hello",
    "Listen",
    "Listening",
    "Message",
    "OpenStream",
    "Output",
    "ProtocolError",
    "ProtocolVersionError",
    "RankStart",
    "Signal",
    "StackRequest",
    "Stacks",
    "Start",
    "Started",
    "ToStreams",
    "Usage",
    "UsageChanges",
    "check_version",
    "decode",
    "encode",
    "local_versions",
    "receive",
    "send",
    "silent",
]

PROTOCOL_VERSION = 3
"""Raised whenever a message changes (a field added, removed or reordered, a kind added or dropped)."""
LOST_AFTER = 5
"""Heartbeats of silence after which the other side counts as lost."""
DEFAULT_HEARTBEAT = 2.0
"""Seconds between heartbeats, both ways (``Nodes(heartbeat=...)`` changes it for a launch)."""
OWN_BEAT_AFTER = 1.5
"""Heartbeats without sending after which an agent beats on its own. Before that it answers each of the
kernel's beats at once (unless it sent something within half a period): the nodes' beats then reach the
kernel together, and each of its reader threads wakes once for many nodes, not once per node."""
RELAY_ENV_PREFIX = "NOTEBOOK_ACCEL_RELAY_"
"""A rank finds the Unix socket of relay ``token`` in ``$NOTEBOOK_ACCEL_RELAY_<token>``."""
USAGE_REFRESH = 10.0
"""Seconds after which an agent sends every rank's usage figures, changed or not (else only visible changes)."""


class ProtocolError(RuntimeError):
    """A peer sent what the kernel <-> agent protocol does not allow here: an unknown or unexpected message."""


class ProtocolVersionError(ProtocolError):
    """The agent speaks another version of the protocol than the kernel (another notebook_accel installation)."""


def local_versions() -> dict[str, str]:
    """Return the versions a node must share with the kernel: Python (major.minor), torch, notebook-accel."""
    versions = {"python": ".".join(platform.python_version_tuple()[:2])}
    for distribution in ("torch", "notebook-accel"):
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[distribution] = "not installed"
    return versions


def check_version(theirs: object, who: str) -> None:
    """Raise ProtocolVersionError naming both versions unless ``theirs`` is this ``PROTOCOL_VERSION``."""
    if theirs != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"{who} speaks version {theirs!r} of the kernel<->agent protocol and this side speaks version "
            f"{PROTOCOL_VERSION}: the two run different notebook_accel installations. Install the same "
            "notebook_accel version on every node (Nodes(python=...) points at an environment), then launch again"
        )


class Message:
    """A message of the kernel <-> agent wire (each kind is a frozen dataclass below)."""

    __slots__ = ()
    KIND: ClassVar[str]


def _message(kind: str):
    """Declare a message class: a frozen, slotted dataclass with its wire ``KIND``."""

    def declare(cls: type) -> type:
        cls.KIND = kind
        return dataclass(frozen=True, slots=True)(cls)

    return declare


# ----------------------------------------------------------------------------- both directions


@_message("hb")
class Heartbeat(Message):
    """I am here: the kernel's every ``heartbeat`` seconds, an agent's in answer (``OWN_BEAT_AFTER``)."""


@_message("close_stream")
class CloseStream(Message):
    """One side of a relayed connection closed."""

    stream_id: int


# ----------------------------------------------------------------------------- kernel -> agent


@dataclass(frozen=True, slots=True)
class RankStart:
    """One rank of a ``Start``: ``wid`` names this start of it (a restarted rank is a new one)."""

    wid: int
    spec: Any
    """The rank's ``WorkerSpec``, its function by value (``launch.procs.by_value``)."""


@_message("start")
class Start(Message):
    """Start these ranks on the node (spawn); one ``Started`` answers the batch."""

    request: int
    sys_path: list[str]
    """The kernel's ``sys.path``; the agent adds the entries that exist on its node (a shared file system)."""
    ranks: list[RankStart]


@_message("signal")
class Signal(Message):
    """Send ``signum`` to the process group of start ``wid``."""

    wid: int
    signum: int


@_message("stacks")
class StackRequest(Message):
    """Dump the stacks of these starts' ranks; ``Stacks`` answers with ``request``."""

    request: int
    wids: list[int]


@_message("listen")
class Listen(Message):
    """Listen on a Unix socket of the node for relay ``token``; ``Listening`` answers."""

    token: str


@_message("to_streams")
class ToStreams(Message):
    """The same bytes for each of these relayed connections (a command to many ranks leaves once per node)."""

    stream_ids: list[int]
    data: bytes


@_message("end")
class End(Message):
    """End every rank and exit."""


# ----------------------------------------------------------------------------- agent -> kernel


@_message("hello")
class Hello(Message):
    """The agent proved the secret: its protocol version (always first), node index, versions and machine."""

    version: int
    node: int
    versions: dict[str, str]
    info: dict[str, Any]
    """``host``, ``pid``, ``gpus``, ``python`` of the agent."""


@_message("started")
class Started(Message):
    """The answer to ``Start`` number ``request``: ``{wid: pid}`` started, ``{wid: error}`` not."""

    request: int
    pids: dict[int, int]
    failed: dict[int, str]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Bytes a rank wrote to one of its pipes: ``stream`` is "stdout", "stderr" or "result"."""

    wid: int
    stream: str
    data: bytes

    def __reduce__(self) -> tuple:
        # Unpickled by its constructor: a slotted frozen dataclass's default state path runs ``fields()``
        # per object, and an ``Output`` at 100 lines/s/rank carries tens of thousands of chunks a second.
        return (Chunk, (self.wid, self.stream, self.data))


@_message("out")
class Output(Message):
    """What the node's ranks wrote since the last ``Output``, in the order read (in order per rank and pipe)."""

    chunks: list[Chunk]


@_message("eof")
class Eof(Message):
    """A rank closed one of its pipes (``stream``)."""

    wid: int
    stream: str


@_message("exit")
class Exited(Message):
    """A rank ended with ``code`` (negative: the signal that ended it)."""

    wid: int
    code: int | None


@_message("usage")
class Usage(Message):
    """``{rank: {"cpu_percent", "rss", "peak_rss"}}`` of the node's running ranks, about once a second."""

    figures: dict[int, dict[str, Any]]


@_message("stack_dump")
class Stacks(Message):
    """The answer to ``StackRequest`` number ``request``: ``{rank: RankStack}`` of the ranks that answered."""

    request: int
    stacks: dict[int, Any]


@_message("listening")
class Listening(Message):
    """The node listens for relay ``token`` at ``path`` (given to ranks started afterwards)."""

    token: str
    path: str


@_message("from_streams")
class FromStreams(Message):
    """What relayed connections sent in one round: ``(stream_id, bytes)``, in order per stream."""

    chunks: list[tuple[int, bytes]]


@_message("open_stream")
class OpenStream(Message):
    """A rank connected to relay ``token``'s socket: a new stream ``stream_id``."""

    token: str
    stream_id: int


class UsageChanges:
    """Which ranks' usage figures an agent sends: those changed visibly (a CPU point, a MiB), all every ``USAGE_REFRESH`` s.

    Idle ranks then cost the kernel no message; the agent's ``Usage`` also counts as its heartbeat.
    """

    def __init__(self) -> None:
        self._shown: dict[int, tuple] = {}
        self._refresh = 0.0

    def select(self, figures: dict[int, dict[str, Any]], now: float) -> dict[int, dict[str, Any]]:
        """Return the part of ``figures`` (``{rank: figures}``) worth sending at ``now`` (time.monotonic())."""
        if now >= self._refresh:
            self._refresh, out = now + USAGE_REFRESH, dict(figures)
        else:
            out = {rank: f for rank, f in figures.items() if _visible(f) != self._shown.get(rank)}
        self._shown.update((rank, _visible(f)) for rank, f in out.items())
        return out


def _visible(figures: dict[str, Any]) -> tuple:
    cpu, rss, peak = (figures.get(k) or 0 for k in ("cpu_percent", "rss", "peak_rss"))
    return round(cpu), int(rss) >> 20, int(peak) >> 20


TO_AGENT: tuple[type[Message], ...] = (
    Heartbeat, Start, Signal, StackRequest, Listen, ToStreams, CloseStream, End,
)  # fmt: skip
"""What the agent accepts from the kernel."""
TO_KERNEL: tuple[type[Message], ...] = (
    Heartbeat, Hello, Started, Output, Eof, Exited, Usage, Stacks, Listening, OpenStream, FromStreams, CloseStream,
)  # fmt: skip
"""What the kernel accepts from an agent."""
MESSAGES: dict[str, type[Message]] = {cls.KIND: cls for cls in (*TO_AGENT, *TO_KERNEL)}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in MESSAGES.values()}


def encode(message: Message) -> bytes:
    """Return the frame body of ``message``: a pickle of ``(KIND, *fields)``."""
    values = tuple(getattr(message, name) for name in _FIELDS[type(message)])
    return pickle.dumps((message.KIND, *values), protocol=pickle.HIGHEST_PROTOCOL)


def decode(body: bytes, expected: tuple[type[Message], ...]) -> Message:
    """Return the message in frame ``body``; ProtocolError unless it is one of ``expected``, well formed."""
    item = pickle.loads(body)
    if not (isinstance(item, tuple) and item and isinstance(item[0], str)):
        raise ProtocolError(f"not a message of the kernel<->agent protocol: {repr(item)[:80]}")
    cls = MESSAGES.get(item[0])
    if cls is None:
        raise ProtocolError(
            f"unknown message type {item[0]!r}: protocol version {PROTOCOL_VERSION} has "
            f"{', '.join(MESSAGES)}; the peer runs another notebook_accel (install the same version on both sides)"
        )
    if cls is Hello and len(item) > 1:
        check_version(item[1], f"the agent of node {item[2] if len(item) > 2 else '?'}")
    names = _FIELDS[cls]
    if len(item) - 1 != len(names):
        raise ProtocolError(
            f"a {cls.KIND!r} message came with {len(item) - 1} field(s); protocol version {PROTOCOL_VERSION} "
            f"gives it {len(names)} ({', '.join(names) or 'none'})"
        )
    if cls not in expected:
        raise ProtocolError(
            f"a {cls.KIND!r} message is not expected here (expected {', '.join(c.KIND for c in expected)})"
        )
    return cls(*item[1:])


def send(channel: Channel, message: Message) -> None:
    """Sign and send ``message`` on ``channel`` (ChannelError when the connection is gone)."""
    channel.send_bytes(encode(message))


def receive(channel: Channel, expected: tuple[type[Message], ...]) -> Message:
    """Return the next message of ``channel`` (blocking): ChannelError when it closed, ProtocolError when not allowed."""
    return decode(channel.recv_bytes(), expected)


def silent(channel: Channel, last_heard: float, heartbeat: float, now: float) -> bool:
    """Return True when the peer on ``channel`` counts as lost: nothing came for ``LOST_AFTER`` heartbeats.

    Its frames waiting unread here are not silence: this side fell behind in reading them (its machine
    was busy), and the peer is there. The kernel applies this to each agent, each agent to the kernel.
    """
    return now - last_heard > LOST_AFTER * heartbeat and not channel.unread()
