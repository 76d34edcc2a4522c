"""The kernel<->agent channel: nothing is unpickled before the secret is proved; a bad frame drops the connection."""

from __future__ import annotations

import json
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from notebook_accel.nodes import channel as channel_mod
from notebook_accel.nodes.channel import Channel, ChannelError, accept_channel, connect_channel, new_secret
from notebook_accel.nodes.protocol import PROTOCOL_VERSION


class _Touch:
    """A pickle whose unpickling creates a file: proof that something was (or was not) unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _listener() -> socket.socket:
    return socket.create_server(("127.0.0.1", 0))


def _pair(secret_kernel: bytes, secret_agent: bytes):
    """Return (kernel result, agent result): a Channel or the exception each side's handshake raised."""
    server = _listener()
    results: dict[str, object] = {}

    def kernel() -> None:
        conn, _ = server.accept()
        try:
            results["kernel"] = accept_channel(conn, secret_kernel, timeout=10)
        except ChannelError as exc:
            results["kernel"] = exc

    thread = threading.Thread(target=kernel)
    thread.start()
    try:
        results["agent"] = connect_channel(server.getsockname(), secret_agent, timeout=10)
    except ChannelError as exc:
        results["agent"] = exc
    thread.join(10)
    server.close()
    return results["kernel"], results["agent"]


def test_both_sides_prove_the_secret_then_messages_travel_signed():
    secret = new_secret()
    assert len(secret) == 32 and secret != new_secret()
    kernel, agent = _pair(secret, secret)
    assert isinstance(kernel, Channel) and isinstance(agent, Channel)
    kernel.send(("start", {"rank": 3}))
    assert agent.recv() == ("start", {"rank": 3})
    agent.send(("out", 3, "stdout", b"hello\n"))
    assert kernel.recv() == ("out", 3, "stdout", b"hello\n")
    kernel.close()
    with pytest.raises(ChannelError, match="closed"):
        agent.recv()
    agent.close()


def test_each_frame_leaves_at_once_both_ways_never_held_for_an_acknowledgement():
    # A frame is one write; with Nagle's algorithm on, a small frame written while the previous one is not yet
    # acknowledged waits for the peer's delayed ACK: 40 ms on Linux (2 simulated nodes x 2 ranks, 400 empty
    # commands: the slowest 43 ms without TCP_NODELAY, 4 ms with it).
    secret = new_secret()
    kernel, agent = _pair(secret, secret)
    try:
        for side in (kernel, agent):
            assert side.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        kernel.close()
        agent.close()


class _CountingSocket:
    """The channel's socket, counting the reads the channel makes."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.reads = sock, 0

    def recv(self, size: int) -> bytes:
        self.reads += 1
        return self._sock.recv(size)

    def recv_into(self, buffer) -> int:
        self.reads += 1
        return self._sock.recv_into(buffer)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def test_frames_that_came_together_are_read_together_and_large_ones_intact():
    secret = new_secret()
    kernel, agent = _pair(secret, secret)
    counting = kernel.sock = _CountingSocket(kernel.sock)
    try:
        small = [("hb", i) for i in range(200)]
        for message in small:
            agent.send(message)
        assert [kernel.recv() for _ in small] == small
        assert counting.reads < 20  # 200 frames: a few reads, not three per frame
        big = os.urandom(3 << 20)  # far over one read: straight into place, after the small frame before it
        sender = threading.Thread(target=lambda: (agent.send("before"), agent.send(big), agent.send("after")))
        sender.start()
        assert [kernel.recv(), kernel.recv(), kernel.recv()] == ["before", big, "after"]
        sender.join(10)
        agent.close()
        with pytest.raises(ChannelError, match="closed"):
            kernel.recv()
    finally:
        kernel.close()
        agent.close()


def test_a_wrong_secret_is_refused_by_both_sides():
    kernel, agent = _pair(new_secret(), new_secret())
    assert isinstance(kernel, ChannelError) and "did not prove the launch's secret" in str(kernel)
    assert isinstance(agent, ChannelError)


def test_a_client_without_the_secret_gets_nothing_unpickled(tmp_path):
    """A peer that skips the handshake and sends a pickle straight away: refused, the pickle never loaded."""
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Touch(str(marker)))
    server = _listener()
    errors = []

    def kernel() -> None:
        conn, _ = server.accept()
        try:
            accept_channel(conn, new_secret(), timeout=10)
        except ChannelError as exc:
            errors.append(exc)

    thread = threading.Thread(target=kernel)
    thread.start()
    with socket.create_connection(server.getsockname()) as rogue:
        rogue.recv(len(channel_mod.MAGIC) + 32)
        rogue.sendall(payload.ljust(64, b"\0") + payload)  # where the proof belongs, then a "frame"
        thread.join(10)
        assert _hung_up(rogue)
    server.close()
    assert errors and "did not prove" in str(errors[0])
    assert not marker.exists()
    # The same payload does create the file once unpickled: the check above can fail.
    pickle.loads(payload).close()
    assert marker.exists()


def _hung_up(sock: socket.socket) -> bool:
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def _wired(secret: bytes):
    """Return (sender, wire, receiver): frames the sender writes arrive on ``wire``; what goes into ``wire`` reaches the receiver."""
    kernel, agent = _pair(secret, secret)
    # Re-home the agent's receiving side on a socketpair the test controls, keeping its keys and counters.
    outer, inner = socket.socketpair()
    receiver = Channel(inner, send_key=agent._send_key, recv_key=agent._recv_key)
    return kernel, agent.sock, outer, receiver


def _read_frame(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += sock.recv(size - len(data))
    return data


def test_a_tampered_frame_is_refused_unread_and_the_connection_dropped(tmp_path):
    marker = tmp_path / "unpickled"
    kernel, tap, wire, receiver = _wired(new_secret())
    body = pickle.dumps(_Touch(str(marker)))
    kernel.send_bytes(body)
    frame = bytearray(_read_frame(tap, 4 + 32 + len(body)))
    frame[-1] ^= 0x01  # one bit of the body
    wire.sendall(bytes(frame))
    with pytest.raises(ChannelError, match="failed its signature check"):
        receiver.recv()
    assert receiver.closed and not marker.exists()
    assert _hung_up(wire)  # dropped


def test_a_replayed_or_reordered_frame_is_refused():
    kernel, tap, wire, receiver = _wired(new_secret())
    kernel.send(("signal", 0, 2))
    first = _read_frame(tap, 4 + 32 + len(pickle.dumps(("signal", 0, 2), protocol=pickle.HIGHEST_PROTOCOL)))
    wire.sendall(first)
    assert receiver.recv() == ("signal", 0, 2)
    wire.sendall(first)  # the same signed frame again
    with pytest.raises(ChannelError, match="replayed or out of order"):
        receiver.recv()


def test_a_frame_sent_back_to_its_sender_does_not_verify():
    """Each direction has its own key: a frame reflected to the side that signed it is refused."""
    secret = new_secret()
    kernel, agent = _pair(secret, secret)
    outer, inner = socket.socketpair()
    reflected = Channel(inner, send_key=kernel._send_key, recv_key=kernel._recv_key)
    body = pickle.dumps("x")
    kernel.send_bytes(body)
    outer.sendall(_read_frame(agent.sock, 4 + 32 + len(body)))
    with pytest.raises(ChannelError, match="signature"):
        reflected.recv()


def test_an_agent_facing_a_kernel_with_another_secret_runs_nothing(tmp_path):
    """The agent refuses a kernel that cannot prove the secret it was given, and exits without serving."""
    server = _listener()
    host, port = server.getsockname()
    boot = {"address": host, "port": port, "secret": new_secret().hex(), "node": 0, "heartbeat": 1.0,
            "protocol": PROTOCOL_VERSION}  # fmt: skip
    agent = subprocess.Popen(
        [sys.executable, "-m", "notebook_accel.nodes.agent"],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    agent.stdin.write((json.dumps(boot) + "\n").encode())
    agent.stdin.close()
    conn, _ = server.accept()
    with pytest.raises(ChannelError):
        accept_channel(conn, new_secret(), timeout=60)
    assert agent.wait(60) == 2
    assert b"cannot reach the kernel" in agent.stderr.read()
    server.close()


def test_an_agent_started_by_hand_says_it_needs_the_kernel():
    done = subprocess.run(
        [sys.executable, "-m", "notebook_accel.nodes.agent"], input=b"", capture_output=True, timeout=120
    )
    assert done.returncode != 0 and b"no bootstrap on stdin" in done.stderr


def _read_ready_until(channel: Channel, count: int, timeout: float = 20.0) -> tuple[list[bytes], int]:
    """Return (the first ``count`` bodies ``read_ready`` gave, how many calls that took), the socket waited on."""
    got, calls, deadline = [], 0, time.monotonic() + timeout
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"{len(got)} of {count} frames within {timeout} s"
        if select.select([channel.sock], [], [], left)[0]:
            bodies, error = channel.read_ready()
            assert error is None
            got, calls = got + bodies, calls + 1
    return got, calls


def test_read_ready_hands_over_the_frames_complete_and_keeps_the_rest():
    secret = new_secret()
    kernel, agent = _pair(secret, secret)
    try:
        for i in range(50):
            agent.send(("hb", i))
        got, calls = _read_ready_until(kernel, 50)  # each call reads once: what came, perhaps a frame cut in two
        assert [pickle.loads(b) for b in got] == [("hb", i) for i in range(50)]
        assert calls < 10  # the frames that came together are handed over together
        big = os.urandom(3 << 20)  # far over one read: read into place, across many calls
        sender = threading.Thread(target=lambda: (agent.send("before"), agent.send(big), agent.send("after")))
        sender.start()
        got, _ = _read_ready_until(kernel, 3)
        sender.join(10)
        assert [pickle.loads(b) for b in got] == ["before", big, "after"]
        agent.close()
        bodies, error = kernel.read_ready()
        assert bodies == [] and isinstance(error, ChannelError) and "closed" in str(error)
        assert kernel.closed
    finally:
        kernel.close()
        agent.close()


def test_read_ready_returns_the_good_frames_before_a_tampered_one_and_never_unpickles_it(tmp_path):
    secret = new_secret()
    kernel, agent = _pair(secret, secret)
    marker = tmp_path / "unpickled"
    try:
        agent.send("first")
        agent.send("second")
        agent.sock.sendall(b"".join([len(b"x").to_bytes(4, "big"), b"\0" * 32, b"x"]))  # a wrong signature
        agent.send(_Touch(str(marker)))  # signed, but after the bad one: never read
        got, error = [], None
        while error is None:
            bodies, error = kernel.read_ready()
            got += bodies
        assert [pickle.loads(b) for b in got] == ["first", "second"]
        assert isinstance(error, ChannelError) and "frame 2 failed its signature check" in str(error)
        assert kernel.closed and not marker.exists()
    finally:
        kernel.close()
        agent.close()


@pytest.mark.parametrize("key_length", [0, 1, 32, 64, 65, 200])
def test_a_frame_is_signed_with_hmac_sha256_of_its_sequence_and_body(key_length):
    import hashlib
    import hmac

    key = os.urandom(key_length)
    signer = channel_mod._FrameSigner(key)
    for body in (b"", b"x", os.urandom(100), os.urandom(70_000)):
        sequence = os.urandom(8)
        assert signer.sign(sequence, body) == hmac.new(key, sequence + body, hashlib.sha256).digest()
    assert signer.sign(b"\0" * 8, b"a") == signer.sign(b"\0" * 8, b"a")  # the key's states are not used up
