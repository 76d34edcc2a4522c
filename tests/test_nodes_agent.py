"""The agent against a hand-driven kernel: it ends its ranks when the kernel goes, and relays Unix-socket streams."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from notebook_accel.launch.events import FrameDecoder
from notebook_accel.launch.procs import by_value
from notebook_accel.launch.worker import WorkerSpec
from notebook_accel.nodes import protocol as wire
from notebook_accel.nodes.channel import Channel, accept_channel, new_secret
from notebook_accel.nodes.protocol import local_versions
from notebook_accel.nodes.relay import relay_address


def sleeper(seconds):
    time.sleep(seconds)


def relay_path(token):
    return relay_address(token)


class FakeKernel:
    """A listener, one agent started here with its bootstrap on stdin, and the authenticated channel to it."""

    def __init__(self, heartbeat: float = 0.3) -> None:
        self.secret = new_secret()
        self.server = socket.create_server(("127.0.0.1", 0))
        host, port = self.server.getsockname()
        boot = {"address": host, "port": port, "secret": self.secret.hex(), "node": 1, "heartbeat": heartbeat,
                "protocol": wire.PROTOCOL_VERSION}  # fmt: skip
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "notebook_accel.nodes.agent"],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.agent.stdin.write((json.dumps(boot) + "\n").encode())
        self.agent.stdin.close()
        self.server.settimeout(120)
        conn, _ = self.server.accept()
        self.channel: Channel = accept_channel(conn, self.secret, timeout=60)
        self.hello = wire.receive(self.channel, (wire.Hello,))

    def next(self, kind: type[wire.Message], timeout: float = 120.0) -> wire.Message:
        """Return the next message of ``kind`` (heartbeats and others skipped)."""
        self.channel.sock.settimeout(timeout)
        while True:
            message = wire.receive(self.channel, wire.TO_KERNEL)
            if isinstance(message, kind):
                return message

    def start(self, rank: int, function, args=()) -> int:
        spec = WorkerSpec(
            rank=rank, local_rank=0, env={"RANK": str(rank), "NODE_RANK": "1"}, num_threads=1,
            backend="gloo", dry_run_port=None, function=function, args=args,
        )  # fmt: skip
        wire.send(
            self.channel, wire.Start(rank, list(sys.path), [wire.RankStart(100 + rank, by_value(spec))])
        )
        started = self.next(wire.Started)
        assert started.request == rank and list(started.pids) == [100 + rank] and not started.failed
        return started.pids[100 + rank]

    def close(self) -> None:
        self.channel.close()
        self.server.close()
        try:
            self.agent.wait(60)  # it cleans up and exits once the connection is gone
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait(30)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_agent_reports_its_node_and_versions():
    kernel = FakeKernel()
    try:
        hello = kernel.hello
        assert (hello.version, hello.node) == (wire.PROTOCOL_VERSION, 1)
        assert hello.versions == local_versions()
        assert hello.info["pid"] == kernel.agent.pid and hello.info["gpus"] == 0
    finally:
        kernel.close()


@pytest.mark.parametrize("how", ["connection closed", "kernel silent"])
def test_the_agent_ends_its_ranks_when_the_kernel_goes(how):
    kernel = FakeKernel(heartbeat=0.3)
    try:
        pid = kernel.start(0, sleeper, (300,))
        assert psutil.pid_exists(pid)
        if how == "connection closed":
            kernel.channel.close()  # as when the kernel dies: its socket closes
        else:
            time.sleep(0.1)  # the connection stays open; the kernel just stops talking (a partition)
        assert kernel.agent.wait(60) == 0
        deadline = time.monotonic() + 10
        while not _gone(pid):
            assert time.monotonic() < deadline, f"rank {pid} outlived its agent"
            time.sleep(0.05)
    finally:
        kernel.close()


def test_unix_socket_streams_are_relayed_and_ranks_find_the_socket():
    kernel = FakeKernel(heartbeat=5.0)
    try:
        wire.send(kernel.channel, wire.Listen("tok1"))
        token, path = (listening := kernel.next(wire.Listening)).token, listening.path
        assert token == "tok1" and os.path.exists(path)
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rank_side,
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other_side,
        ):
            rank_side.connect(path)
            rank_side.sendall(b"ping")
            opened = kernel.next(wire.OpenStream)
            assert opened.token == "tok1"
            stream_id = opened.stream_id
            assert kernel.next(wire.FromStreams) == wire.FromStreams([(stream_id, b"ping")])
            other_side.connect(path)
            other_id = kernel.next(wire.OpenStream).stream_id
            # One message for both connections: the agent copies the bytes to each.
            wire.send(kernel.channel, wire.ToStreams([stream_id, other_id], b"pong"))
            for side in (rank_side, other_side):
                side.settimeout(60)
                assert side.recv(10) == b"pong"
            rank_side.close()
            assert kernel.next(wire.CloseStream).stream_id == stream_id
        assert kernel.next(wire.CloseStream).stream_id == other_id
        # A rank started after the relay opened finds its socket in its environment.
        kernel.start(4, relay_path, ("tok1",))
        decoder, messages = FrameDecoder(), []
        while not any(m[0] == "ok" for m in messages):
            for chunk in kernel.next(wire.Output).chunks:
                if chunk.stream == "result":
                    messages += decoder.feed(chunk.data)
        assert [m for m in messages if m[0] == "ok"] == [("ok", path)]
    finally:
        kernel.close()
    assert not os.path.exists(path)  # the agent removed its socket on the way out


def say_and_exit(code):
    print("hello from the rank", flush=True)
    raise SystemExit(code)


class _SentMessages:
    """A stand-in for the agent's channel: keeps what the agent sends."""

    def __init__(self) -> None:
        self.sent: list[wire.Message] = []

    def send_bytes(self, body: bytes) -> None:
        self.sent.append(wire.decode(body, wire.TO_KERNEL))

    def close(self) -> None:
        pass


def test_the_agent_supervises_its_ranks_with_the_kernels_rank_supervisor():
    from notebook_accel.launch.supervisor import RankSupervisor
    from notebook_accel.nodes.agent import Agent

    channel = _SentMessages()
    agent = Agent(channel, node=1, heartbeat=5.0, kernel_address="127.0.0.1")
    try:
        assert type(agent.pipes) is RankSupervisor and agent.pipes.selector is agent.sel
        spec = WorkerSpec(
            rank=3, local_rank=0, env={"RANK": "3", "NODE_RANK": "1"}, num_threads=1,
            backend="gloo", dry_run_port=None, function=say_and_exit, args=(7,),
        )  # fmt: skip
        agent._start(wire.Start(1, list(sys.path), [wire.RankStart(42, by_value(spec))]))
        local = agent.ranks[42]
        assert agent.pipes.ranks == [local] and sorted(local.fds.values()) == ["result", "stderr", "stdout"]
        deadline = time.monotonic() + 120
        while 42 in agent.ranks:  # the relay loop of serve(), without the kernel's thread
            assert time.monotonic() < deadline, "the rank's end was never reported"
            for key, _ in agent.sel.select(0.5):
                agent._on_ready(key)
            agent._flush()
        for key, _ in agent.sel.select(0.2):  # nothing of the rank is left to report
            agent._on_ready(key)
        agent._flush()
        sent = [m for m in channel.sent if not isinstance(m, wire.Heartbeat)]
        assert [m for m in sent if isinstance(m, wire.Exited)] == [wire.Exited(42, 7)]  # reported once
        assert sorted(m.stream for m in sent if isinstance(m, wire.Eof)) == ["result", "stderr", "stdout"]
        stdout = b"".join(c.data for m in sent if isinstance(m, wire.Output) for c in m.chunks if c.stream == "stdout")
        assert b"hello from the rank" in stdout
        assert agent.pipes.ranks == [] and local.exited  # forgotten once drained: close() leaves it alone
    finally:
        agent._shutdown()


def test_an_agent_behind_in_reading_its_kernel_does_not_take_it_for_silent():
    """The kernel's frames waiting unread (in the socket, or read ahead) are not silence: only a busy agent's lag."""
    from notebook_accel.nodes.agent import Agent

    kernel_end, agent_end = socket.socketpair()
    kernel = Channel(kernel_end, send_key=b"k" * 32, recv_key=b"a" * 32)
    agent = Agent(Channel(agent_end, send_key=b"a" * 32, recv_key=b"k" * 32), 1, 1.0, "127.0.0.1")

    def silent() -> bool:
        return wire.silent(agent.channel, agent.last_heard, agent.heartbeat, time.monotonic())

    try:
        agent.last_heard = time.monotonic() - 10 * wire.LOST_AFTER  # its reader has not run for long
        assert silent()  # nothing came meanwhile: the kernel is lost
        wire.send(kernel, wire.Heartbeat())
        wire.send(kernel, wire.Heartbeat())
        assert not silent()  # two beats wait in the socket
        beat = wire.decode(agent.channel.recv_bytes(), wire.TO_AGENT)  # both read, one returned
        assert beat == wire.Heartbeat()
        assert not silent()  # the other waits, read ahead
        agent.channel.recv_bytes()
        assert silent()  # all handed over, and last_heard never moved: silent
        kernel_end.sendall(b"\0\0\0\x40" + b"x" * 40)  # a frame's start (its header, part of its MAC)
        assert not silent()  # unread in the socket
        assert agent.channel.read_ready() == ([], None)  # read, and kept for the rest of the frame
        assert silent()  # the kernel stopped mid-frame: that is silence
    finally:
        agent._shutdown()
        kernel.close()


def test_the_agent_starts_without_importing_torch():
    """A node's agent only starts and relays ranks: importing torch would cost each node seconds at every launch."""
    code = "import sys, notebook_accel.nodes.agent; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_agent_answers_each_heartbeat_at_once_and_beats_alone_only_when_the_kernel_is_quiet():
    """Answered at once, the nodes' beats reach the kernel together: its readers wake once for many nodes."""
    kernel = FakeKernel(heartbeat=4.0)
    try:
        kernel.next(wire.Heartbeat, timeout=30)  # the one it sends on its own before the kernel beat
        for _ in range(3):
            time.sleep(2.1)  # past half a period since it last sent: the beat is answered
            sent = time.monotonic()
            wire.send(kernel.channel, wire.Heartbeat())
            kernel.next(wire.Heartbeat, timeout=1.5)  # far sooner than its own beat would come
            assert time.monotonic() - sent < 1.5
        quiet = time.monotonic()  # the kernel stops beating: the agent beats alone, after 1.5 periods
        kernel.next(wire.Heartbeat, timeout=30)
        assert wire.OWN_BEAT_AFTER * 4.0 - 0.5 <= time.monotonic() - quiet <= wire.OWN_BEAT_AFTER * 4.0 + 3.0
    finally:
        kernel.close()
