"""Simulated node agents that speak the real kernel<->agent protocol, for measuring the kernel's side at scale.

``SimPlacement(nodes, ...)`` is a ``Placement`` like Slurm's or SSH's, but each "node" is an agent thread
in one of a few host processes on this machine (``python -m tests.nodes_sim CONFIG``, 32 nodes a
process by default), so 128 nodes x 8 ranks cost a few processes, not 1,024. Each simulated agent
connects back with the launch's secret (``channel``), says ``Hello`` and answers the kernel's messages
(``nodes/protocol.py``) as the real agent does, but its ranks are simulated; no rank process, no torch
in a rank:

- ``mode="lines"``: each rank writes ``rate`` lines a second (``r<rank> <i>``, ``i`` counting from 0)
  for ``seconds`` seconds, relayed in one ``Output`` per node and tick, then returns None (a real
  ``("ok", None)`` result frame) and exits 0; ``rate=0`` keeps the ranks idle until stopped;
- ``mode="interactive"``: each rank connects to the kernel's relay (``OpenStream``), says ``Ready``
  (the kernel<->rank protocol) and answers every command with ``Ok`` (an empty value), until the kernel
  closes its stream.

Either way the agents send heartbeats and usage figures (about once a second) as the real one does.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from notebook_accel.interactive import protocol as rank_wire
from notebook_accel.nodes import protocol as wire
from notebook_accel.nodes.channel import ChannelError, connect_channel
from notebook_accel.nodes.placement import Placement
from notebook_accel.nodes.spec import Nodes
from notebook_accel.utils._worker_channel import FRAME_HEADER

ROOT = Path(__file__).resolve().parents[1]
_FAKE_PID = 10_000_000  # above any pid_max: never a process of this machine
_TICK = 0.02
_IDLE_TICK = 0.25


def never_called() -> None:
    """The launched function: the simulated ranks never run it."""


class _SimRank:
    """One simulated rank of a node."""

    def __init__(self, wid: int, rank: int, relay: str | None) -> None:
        self.wid, self.rank, self.relay = wid, rank, relay
        self.sent = 0  # lines written so far
        self.stream: int | None = None
        self.commands = rank_wire.MessageReader(rank_wire.COMMANDS)
        self.done = False


class SimAgent:
    """One simulated node: the real channel and protocol, simulated ranks."""

    def __init__(self, boot: dict[str, Any], config: dict[str, Any]) -> None:
        self.node, self.config = int(boot["node"]), config
        self.heartbeat = float(boot["heartbeat"])
        self.last_sent = 0.0  # when this agent last sent anything (a heartbeat is due only after silence)
        self.channel = connect_channel((boot["address"], int(boot["port"])), bytes.fromhex(boot["secret"]))
        self.ranks: dict[int, _SimRank] = {}
        self.streams: dict[int, _SimRank] = {}
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.started_at = time.monotonic()
        info = {"host": f"sim{self.node}", "pid": os.getpid(), "gpus": 0, "python": sys.executable}
        self.send(wire.Hello(wire.PROTOCOL_VERSION, self.node, wire.local_versions(), info))

    def send(self, message: wire.Message) -> None:
        try:
            wire.send(self.channel, message)
            self.last_sent = time.monotonic()
        except ChannelError:
            self.ended.set()

    def serve(self) -> None:
        threading.Thread(target=self._tick, daemon=True).start()
        try:
            while not self.ended.is_set():
                self._on(wire.receive(self.channel, wire.TO_AGENT))
        except ChannelError:
            pass
        self.ended.set()
        self.channel.close()

    def _on(self, message: wire.Message) -> None:
        if isinstance(message, wire.Start):
            self._start(message)
        elif isinstance(message, wire.Signal):
            rank = self.ranks.get(message.wid)
            if rank is not None and message.signum != signal.SIGINT:
                self._end(rank, -message.signum, None)
        elif isinstance(message, wire.StackRequest):
            self.send(wire.Stacks(message.request, {}))
        elif isinstance(message, wire.Heartbeat):  # as the real agent: answered at once
            if time.monotonic() - self.last_sent >= self.heartbeat / 2:
                self.send(wire.Heartbeat())
        elif isinstance(message, wire.Listen):
            self.send(wire.Listening(message.token, f"/sim/{self.node}/{message.token}"))
        elif isinstance(message, wire.ToStreams):
            shared: dict[str, bytes] = {}  # the ranks read the same bytes alike: decoded and answered once
            replies = [
                self._command(self.streams.get(sid), message.data, shared) for sid in message.stream_ids
            ]
            chunks = [chunk for chunk in replies if chunk is not None]
            if chunks:  # as the real agent: the replies read in one round travel in one message
                self.send(wire.FromStreams(chunks))
        elif isinstance(message, wire.CloseStream):
            rank = self.streams.pop(message.stream_id, None)
            if rank is not None:  # the kernel closed the connection: the rank's loop returns
                self._end(rank, 0, pickle.dumps(("ok", None)))
        elif isinstance(message, wire.End):
            self.ended.set()

    def _start(self, start: wire.Start) -> None:
        pids = {}
        for item in start.ranks:
            interactive = self.config["mode"] == "interactive"
            relay = pickle.loads(item.spec.payload)[1][3] if interactive else None  # rank_main's relay token
            rank = self.ranks[item.wid] = _SimRank(item.wid, item.spec.rank, relay)
            pids[item.wid] = _FAKE_PID + item.wid
            if relay is not None:
                rank.stream = item.wid  # the agent numbers its streams; one per rank here
                self.streams[rank.stream] = rank
        self.send(wire.Started(start.request, pids, {}))
        for item in start.ranks:
            rank = self.ranks[item.wid]
            if rank.stream is not None:
                self.send(wire.OpenStream(rank.relay, rank.stream))
                ready = rank_wire.Ready(rank=rank.rank, pid=_FAKE_PID + rank.wid)
                self.send(wire.FromStreams([(rank.stream, rank_wire.encode(ready))]))

    def _command(
        self, rank: _SimRank | None, data: bytes, shared: dict[str, bytes]
    ) -> tuple[int, bytes] | None:
        """Return ``(stream, bytes)``: the simulated rank's replies to the commands in ``data``.

        ``shared`` holds the replies of a rank that read ``data`` from a clean start (whole frames): a rank
        whose reader holds no partial frame either would read the same, so it is answered alike without
        decoding (a real node's ranks each decode on their own cores, not on the kernel's, as here).
        """
        if rank is None:
            return None
        clean = not rank.commands.pending
        if clean and "replies" in shared:
            replies = bytes(memoryview(shared["replies"]))  # its own bytes, as each rank's on the wire
        else:
            empty = {"text": None, "html": None, "value": None, "digest": None}
            commands = rank.commands.feed(data)
            replies = b"".join(rank_wire.encode(rank_wire.Ok(seq=c.seq, payload=empty)) for c in commands)
            if clean and not rank.commands.pending:
                shared["replies"] = replies
        return (rank.stream, replies) if replies else None

    def _end(self, rank: _SimRank, code: int, result: bytes | None) -> None:
        with self.lock:
            if rank.done:
                return
            rank.done = True
        if result is not None:
            self.send(wire.Output([wire.Chunk(rank.wid, "result", FRAME_HEADER.pack(len(result)) + result)]))
        for stream in ("stdout", "stderr", "result"):
            self.send(wire.Eof(rank.wid, stream))
        self.send(wire.Exited(rank.wid, code))

    def _tick(self) -> None:
        """Every tick: the lines due, as one Output; a heartbeat and usage figures when due."""
        rate, seconds = float(self.config.get("rate", 0)), float(self.config.get("seconds", 0))
        next_usage, usage = 0.0, wire.UsageChanges()
        # Lines are due every tick; without them, usage (once a second) and heartbeats need far fewer wakes,
        # and the simulated nodes' own CPU (on the kernel's cores here) stays out of the kernel's figures.
        tick = _TICK if self.config["mode"] == "lines" and rate else _IDLE_TICK
        while not self.ended.wait(tick):
            now = time.monotonic()
            live = [r for r in list(self.ranks.values()) if not r.done]
            if now >= next_usage and live:  # as the real agent: figures once a second, sent when changed
                figures = {r.rank: {"cpu_percent": 1.0, "rss": 1 << 20, "peak_rss": 1 << 20} for r in live}
                if figures := usage.select(figures, now):
                    self.send(wire.Usage(figures))
                next_usage = now + 1.0
            if now - self.last_sent >= wire.OWN_BEAT_AFTER * self.heartbeat:  # as the real agent
                self.send(wire.Heartbeat())
            if self.config["mode"] != "lines" or not rate:
                continue
            chunks, finished = [], []
            for rank in live:
                due = int(min(now - self.started_at, seconds) * rate)
                if due > rank.sent:
                    text = "".join(f"r{rank.rank} {i}\n" for i in range(rank.sent, due))
                    chunks.append(wire.Chunk(rank.wid, "stdout", text.encode()))
                    rank.sent = due
                if now - self.started_at >= seconds:
                    finished.append(rank)
            if chunks:
                self.send(wire.Output(chunks))
            for rank in finished:
                self._end(rank, 0, pickle.dumps(("ok", None)))


class _Forward:
    """A node's stdin: its bootstrap line goes to its host process's stdin."""

    def __init__(self, host: subprocess.Popen) -> None:
        self._host = host

    def write(self, data: bytes) -> None:
        self._host.stdin.write(data)
        self._host.stdin.flush()

    def close(self) -> None:
        """The host's stdin stays open for its other nodes."""


class _NodeProcess:
    """What ``NodeGroup`` holds of one node's engine process: here the host process of its agent."""

    stdout = None

    def __init__(self, host: subprocess.Popen) -> None:
        self.host, self.stdin = host, _Forward(host)

    def poll(self) -> int | None:
        return self.host.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.host.wait(timeout)

    @property
    def returncode(self) -> int | None:
        return self.host.returncode

    def send_signal(self, signum: int) -> None:
        self.host.send_signal(signum)

    def kill(self) -> None:
        self.host.kill()


class SimPlacement(Placement):
    """``nodes`` simulated nodes (``sim0``...), ``per_host`` agents a host process; see the module docstring."""

    name = "sim"

    def __init__(self, nodes: int, *, per_host: int = 32, heartbeat: float = 2.0, **config: Any) -> None:
        super().__init__(Nodes(hosts=[f"sim{i}" for i in range(nodes)], engine="ssh", heartbeat=heartbeat))
        self.per_host, self.config = per_host, {"mode": "lines", **config}
        self.hosts_started: list[subprocess.Popen] = []

    def hosts(self) -> list[str]:
        return list(self.nodes.hosts)

    def node_address(self, host: str) -> str | None:
        return "127.0.0.1"

    def command(self, host: str, argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
        return [sys.executable, "-m", "tests.nodes_sim", json.dumps(self.config)], None

    def start(self, index: int, host: str, argv: list[str]) -> Any:
        if index % self.per_host == 0:
            count = min(self.per_host, len(self.nodes.hosts) - index)
            popen = subprocess.Popen(
                [*self.command(host, argv)[0], str(count)],
                stdin=subprocess.PIPE,
                cwd=ROOT,
                start_new_session=True,
            )
            self.hosts_started.append(popen)
        return _NodeProcess(self.hosts_started[-1])

    def stderr_text(self, index: int, wait: float = 0.0) -> str:
        return ""

    def stop(self, popen: Any, timeout: float = 3.0) -> int:
        if popen.poll() is None:
            popen.kill()
        return popen.wait()


def _host_main(config: dict[str, Any], count: int) -> None:
    """Run ``count`` simulated agents, one per bootstrap line on stdin; return when all ended."""
    agents = []
    for _ in range(count):
        boot = json.loads(sys.stdin.buffer.readline())
        wire.check_version(boot.get("protocol"), "the kernel")
        agent = SimAgent(boot, config)
        thread = threading.Thread(target=agent.serve, daemon=True)
        thread.start()
        agents.append(thread)
    for thread in agents:
        thread.join()


if __name__ == "__main__":
    _host_main(json.loads(sys.argv[1]), int(sys.argv[2]))
