"""The kernel side of a launch across nodes: one agent per node, joined, authenticated, watched.

``NodeGroup.join(placement, ...)`` listens on the kernel's address only (a free port), has the
placement engine start ``python -m notebook_accel.nodes.agent`` on every node, writes each agent
its bootstrap (with the launch's secret) on stdin, and waits for every node to connect, prove the
secret and report its versions. A node that does not join in time, or whose versions differ from
the kernel's, fails the join with an error naming it (and the engine's own message); whatever was
started elsewhere is ended first. Afterwards a few threads (``reader.ChannelReader``: a selector
each, for up to 16 nodes) read the agents' messages and push the ranks' output and
exits into the launch's inbox (``WorkerBackend.pushes``: no pipe per rank), and a heartbeat thread
notices a node gone silent; a lost node fails every rank it ran with an error naming it, and the
launch stops the others as after any failure.
"""

from __future__ import annotations

import itertools
import json
import logging
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..launch.doctor import RankStack
from ..launch.interfaces import WorkerBackend, WorkerProcess, WorkerStart
from ..launch.procs import by_value
from . import protocol as wire
from .channel import Channel, ChannelError, accept_channel, new_secret
from .placement import Placement
from .protocol import DEFAULT_HEARTBEAT, local_versions
from .reader import ChannelReader
from .relay import StreamRelay
from .workers import RemoteStacks, RemoteUsage, RemoteWorkerProcess

__all__ = ["NodeGroup", "NodeJoinError", "NodeSettings"]

logger = logging.getLogger(__name__)

_START_SECONDS = 60.0  # how long starting one rank may take on its node (spawn + its pipes)
_STACKS_SECONDS = 3.0
# Nodes per reader thread: one for all gets too small a share of the GIL in an output burst (issue 33 notes).
_NODES_PER_READER = 16


class NodeJoinError(RuntimeError):
    """A node did not join the launch: never connected, failed to start, or runs other versions."""


@dataclass(frozen=True)
class NodeSettings:
    """What the kernel side needs of ``Nodes``: how long a node may take to join, and the heartbeat."""

    join_timeout: float = 60.0
    heartbeat: float = DEFAULT_HEARTBEAT
    """Seconds between heartbeats, both ways; ``LOST_AFTER`` of them silent and the node counts as lost."""

    @classmethod
    def of(cls, nodes: Any) -> NodeSettings:
        """Return the settings of a ``Nodes`` (None, or a missing attribute: the default)."""
        given = {name: getattr(nodes, name, None) for name in ("join_timeout", "heartbeat")}
        return cls(**{name: float(value) for name, value in given.items() if value is not None})


@dataclass
class _Node:
    """One node of the group: its agent's process (placed by the engine), channel and ranks."""

    index: int
    host: str
    popen: subprocess.Popen
    channel: Channel | None = None
    info: dict[str, Any] = field(default_factory=dict)
    procs: dict[int, RemoteWorkerProcess] = field(default_factory=dict)
    last_heard: float = field(default_factory=time.monotonic)
    lost: str | None = None

    def send_quietly(self, message: wire.Message) -> None:
        """Send ``message`` to the agent; a lost node is handled by the reader, not here."""
        if self.channel is not None and self.lost is None:
            try:
                wire.send(self.channel, message)
            except ChannelError:
                pass


class NodeGroup(WorkerBackend):
    """The agents of one launch: ``start`` gives ``RemoteWorkerProcess``es the handle supervises."""

    pushes = True  # the ranks' output and exits go into WorkerStart.inbox

    def __init__(
        self, placement: Placement, settings: NodeSettings, address: str, nodes: list[_Node]
    ) -> None:
        self.placement, self.settings, self.address = placement, settings, address
        self.nodes = nodes
        self.hosts = tuple(node.host for node in nodes)
        self._closing = False
        self._starts: dict[
            int, tuple[threading.Event, list[wire.Started], int]
        ] = {}  # request: ..., node index
        self._stacks: dict[int, tuple[threading.Event, list[dict[int, RankStack]]]] = {}
        self._ids = itertools.count(1)
        for node in nodes:  # the join itself may have taken several heartbeats
            node.last_heard = time.monotonic()
        self.figures: dict[int, dict[str, Any]] = {}
        self.relay = StreamRelay(self)
        groups = [nodes[i : i + _NODES_PER_READER] for i in range(0, len(nodes), _NODES_PER_READER)]
        self.readers = [
            ChannelReader([(n.channel, n) for n in group], self._on_frame, self._on_closed, f"notebook_accel-nodes-{i}")
            for i, group in enumerate(groups)
        ]
        self._beating = threading.Thread(target=self._beat, name="notebook_accel-heartbeat", daemon=True)
        self._beating.start()

    @property
    def gpus(self) -> int:
        """Return the fewest CUDA devices any node has."""
        return min(int(node.info.get("gpus", 0)) for node in self.nodes)

    # ----------------------------------------------------------------- joining

    @classmethod
    def join(cls, placement: Placement, settings: NodeSettings) -> NodeGroup:
        """Return the group once an agent on every node of ``placement`` joined; NodeJoinError otherwise."""
        hosts = list(placement.hosts())
        address = placement.kernel_address(hosts)
        secret = new_secret()
        listener = socket.create_server((address, 0))  # this address only, never every interface
        port = listener.getsockname()[1]
        argv = placement.agent_argv()
        nodes: list[_Node] = []
        try:
            for index, host in enumerate(hosts):
                popen = placement.start(index, host, argv)
                nodes.append(_Node(index, host, popen))
                boot = {"address": address, "port": port, "secret": secret.hex(), "node": index,
                        "heartbeat": settings.heartbeat, "connect_timeout": settings.join_timeout,
                        "protocol": wire.PROTOCOL_VERSION}  # fmt: skip
                try:
                    popen.stdin.write((json.dumps(boot) + "\n").encode())
                    popen.stdin.close()
                except OSError:
                    pass  # it ended at once: the join reports the engine's message
            _accept_all(listener, secret, nodes, placement, settings.join_timeout)
        except BaseException:
            _end_agents(placement, nodes)
            raise
        finally:
            listener.close()
            del secret
        return cls(placement, settings, address, nodes)

    # ----------------------------------------------------------------- what the handle uses

    def start(self, method: str, starts: Sequence[WorkerStart]) -> list[WorkerProcess]:
        """Return the started ranks of ``starts``, each on its node ``NODE_RANK``: one round trip per node.

        Always spawn there (``method`` is the kernel's). Each node gets one ``Start`` with all its ranks;
        all or none: when one cannot start, those that did are killed, and RuntimeError names its node and rank.
        """
        procs, batches = [], {}
        for start in starts:
            if start.inbox is None:
                raise ValueError(
                    f"the start of rank {start.spec.rank} has no inbox: NodeGroup pushes its ranks' output "
                    "(pushes=True); start it with supervisor.start_workers, which gives one"
                )
        for start in starts:
            node = self.nodes[int(start.spec.env["NODE_RANK"])]
            proc = RemoteWorkerProcess(node, start.spec.rank, start.inbox, next(self._ids))  # wid: this start
            procs.append(proc)
            batches.setdefault(node.index, []).append(wire.RankStart(proc.wid, by_value(start.spec)))
        try:
            self._start_batches(batches, {proc.wid: proc for proc in procs})
        except BaseException:
            for proc in procs:
                if proc.pid is not None:
                    proc.kill_and_reap()
                proc.close()
            raise
        return procs

    def _start_batches(
        self, batches: dict[int, list[wire.RankStart]], procs: dict[int, RemoteWorkerProcess]
    ) -> None:
        """Send each node its ``Start``, then wait for every ``Started`` (one deadline for all)."""
        waits = []
        for index, batch in batches.items():
            node = self.nodes[index]
            if node.lost is not None:
                raise RuntimeError(f"node {node.host} was lost: {node.lost}")
            request = next(self._ids)
            self._starts[request] = (threading.Event(), [], index)
            node.procs.update({item.wid: procs[item.wid] for item in batch})
            waits.append((node, request, batch))
            node.send_quietly(wire.Start(request, [p for p in sys.path if p], batch))
        deadline = time.monotonic() + _START_SECONDS
        problems = []
        for node, request, batch in waits:
            done, answer, _ = self._starts[request]
            done.wait(max(0.0, deadline - time.monotonic()))
            self._starts.pop(request, None)
            started = answer[0] if answer else wire.Started(request, {}, {})
            for item in batch:
                procs[item.wid].pid = started.pids.get(item.wid)
                if procs[item.wid].pid is None:
                    why = (
                        started.failed.get(item.wid) or node.lost or f"no answer within {_START_SECONDS:g} s"
                    )
                    problems.append(f"node {node.host} could not start rank {item.spec.rank}: {why}")
        if problems:
            raise RuntimeError("; ".join(problems))

    def stack_source(self) -> RemoteStacks:
        """Return the handle's stack collector for ranks on these nodes."""
        return RemoteStacks(self.stacks)

    def usage_source(self) -> RemoteUsage:
        """Return the handle's usage sampler for ranks on these nodes."""
        return RemoteUsage(self.figures)

    def stacks(self, ranks: dict[int, int]) -> dict[int, RankStack]:
        """Return the stacks of ``ranks`` (``{rank: pid}``) that their agents sent within a few seconds."""
        waits = []
        for node in self.nodes:
            mine = [wid for wid, p in node.procs.items() if p.rank in ranks and p.exitcode is None]
            if mine and node.lost is None:
                request_id = next(self._ids)
                done, got = self._stacks[request_id] = (threading.Event(), [])
                node.send_quietly(wire.StackRequest(request_id, mine))
                waits.append((request_id, done, got, node.host))
        out: dict[int, RankStack] = {}
        deadline = time.monotonic() + _STACKS_SECONDS
        for request_id, done, got, host in waits:
            done.wait(max(0.0, deadline - time.monotonic()))
            self._stacks.pop(request_id, None)
            for stacks in got:
                out.update({rank: replace(stack, node=host) for rank, stack in stacks.items()})
        return out

    def close(self) -> None:
        """End the session with every agent (they end their ranks and exit); idempotent."""
        if self._closing:
            return
        self._closing = True
        for node in self.nodes:
            node.send_quietly(wire.End())
        for node in self.nodes:
            if node.channel is not None:
                node.channel.close()
        for reader in self.readers:
            reader.close()
        self.relay.close()
        # The agents end their ranks and exit by themselves once their channel closed; waiting for that
        # (and stopping an engine that hangs on, e.g. ssh to a node cut off) is not the launch's time.
        self._reaper = threading.Thread(
            target=_end_agents,
            args=(self.placement, self.nodes),
            name="notebook_accel-agents-end",
            daemon=True,
        )
        self._reaper.start()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Return True once every agent's process (the engine's) has ended after ``close()``."""
        reaper = getattr(self, "_reaper", None)
        if reaper is None:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        threads = [reaper, self._beating, *(reader.thread for reader in self.readers)]
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    # ----------------------------------------------------------------- threads

    def _on_frame(self, node: _Node, body: bytes) -> None:
        node.last_heard = time.monotonic()
        self._dispatch(node, wire.decode(body, wire.TO_KERNEL))

    def _on_closed(self, node: _Node, error: Exception) -> None:
        if not isinstance(error, ChannelError):
            logger.error("node %s: reading its agent failed", node.host, exc_info=error)
            self._lose(node, f"reading its agent failed: {error!r}")
        elif not self._closing:
            code = node.popen.poll()
            ended = f", its agent exited with code {code}" if code is not None else ""
            self._lose(node, f"the connection to its agent closed ({error}){ended}")

    def _dispatch(self, node: _Node, message: wire.Message) -> None:
        if isinstance(message, wire.Output):  # may wait for the inbox's room: the nodes' frames wait meanwhile
            for chunk in message.chunks:
                proc = node.procs.get(chunk.wid)
                if proc is not None:
                    proc.feed(chunk.stream, chunk.data)
        elif isinstance(message, (wire.Eof, wire.Exited)):
            proc = node.procs.get(message.wid)
            if proc is not None and isinstance(message, wire.Eof):
                proc.end_stream(message.stream)
            elif proc is not None:
                proc.exited(message.code)
        elif isinstance(message, wire.Started):
            self._answer(self._starts, message.request, message)
        elif isinstance(message, wire.Usage):
            self.figures.update(message.figures)
        elif isinstance(message, wire.Stacks):
            self._answer(self._stacks, message.request, message.stacks)
        elif isinstance(message, (wire.Listening, wire.OpenStream, wire.FromStreams, wire.CloseStream)):
            self.relay.on_message(node, message)

    @staticmethod
    def _answer(pending: dict[int, tuple], request: int, answer: Any) -> None:
        waiting = pending.get(request)
        if waiting is not None:
            waiting[1].append(answer)
            waiting[0].set()

    def _beat(self) -> None:
        period = self.settings.heartbeat
        next_beat = 0.0
        while not self._closing:
            now = time.monotonic()
            beat, next_beat = (
                now >= next_beat,
                max(next_beat, now - period) + period if now >= next_beat else next_beat,
            )
            for node in self.nodes:
                if node.lost is not None:
                    continue
                if beat:
                    node.send_quietly(wire.Heartbeat())
                if wire.silent(node.channel, node.last_heard, period, now):
                    self._lose(node, f"no heartbeat from its agent for {now - node.last_heard:.1f} s")
            time.sleep(min(period, 0.5))

    def _lose(self, node: _Node, reason: str) -> None:
        if node.lost is not None or self._closing:
            return
        node.lost = reason
        logger.warning("node %s lost: %s", node.host, reason)
        if node.channel is not None:
            node.channel.close()
        said = " | ".join(self.placement.stderr_text(node.index).strip().splitlines()[-5:])
        text = f"node {node.host} (node {node.index}) was lost: {reason}" + (
            f"; its agent said: {said}" if said else ""
        )
        for proc in list(node.procs.values()):
            proc.lost(text)
        for done, _, index in list(self._starts.values()):
            if index == node.index:  # its ranks' start waits no longer
                done.set()
        self.relay.node_lost(node)


def _accept_all(
    listener: socket.socket, secret: bytes, nodes: list[_Node], placement: Placement, timeout: float
) -> None:
    """Accept and authenticate one agent per node within ``timeout``; raise NodeJoinError naming any that did not join."""
    deadline = time.monotonic() + timeout
    waiting = {node.index: node for node in nodes}
    expected = local_versions()
    with selectors.DefaultSelector() as sel:
        sel.register(listener, selectors.EVENT_READ)
        while waiting:
            left = deadline - time.monotonic()
            for node in waiting.values():
                if node.popen.poll() is not None:  # the engine gave up (ssh refused, srun refused, no python)
                    raise NodeJoinError(_not_joined(node, placement, "its agent ended before it joined"))
            if left <= 0:
                node = next(iter(waiting.values()))
                raise NodeJoinError(
                    _not_joined(node, placement, f"it did not join within join_timeout={timeout:g} s")
                )
            if not sel.select(min(left, 0.2)):
                continue
            conn, peer = listener.accept()
            try:
                channel = accept_channel(conn, secret, timeout=min(10.0, max(left, 1.0)))
                hello = wire.receive(channel, (wire.Hello,))
            except ChannelError as exc:
                logger.warning("refused a connection from %s: %s", peer[0], exc)
                continue
            except wire.ProtocolVersionError as exc:
                channel.close()
                raise NodeJoinError(f"{exc}; no rank was started") from None
            except wire.ProtocolError as exc:
                logger.warning("refused the agent at %s: %s", peer[0], exc)
                channel.close()
                continue
            node = waiting.get(hello.node)
            if node is None:
                channel.close()
                continue
            node.channel, node.info = channel, dict(hello.info)
            _check_versions(node, expected, hello.versions)
            del waiting[node.index]


def _check_versions(node: _Node, expected: dict[str, str], got: dict[str, str]) -> None:
    differ = [
        f"{name} {got.get(name)!s} there, {mine} here"
        for name, mine in expected.items()
        if got.get(name) != mine
    ]
    if differ:
        raise NodeJoinError(
            f"node {node.host} (node {node.index}) runs other versions than this kernel: {'; '.join(differ)}. "
            "Install the same versions there, or point Nodes(python=...) at an environment that has them; "
            "no rank was started"
        )


def _not_joined(node: _Node, placement: Placement, why: str) -> str:
    engine = placement.failure(node.index, node.host, node.popen)  # it stops an engine still running
    return (
        f"node {node.host} (node {node.index}) did not join the launch: {why}. "
        f"{getattr(placement, 'name', 'the placement engine')} said: {engine or '(nothing)'}"
    )


def _end_agents(placement: Placement, nodes: list[_Node], wait: float = 10.0) -> None:
    """Close every agent's channel and make sure its process (the engine's step) ends."""
    for node in nodes:
        if node.channel is not None:
            node.channel.close()
    deadline = time.monotonic() + wait
    for node in nodes:
        try:  # an agent whose channel closed ends its ranks and exits by itself
            node.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            placement.stop(node.popen)
        for stream in (node.popen.stdin, node.popen.stdout):
            if stream is not None:
                stream.close()
