"""The two transports between the kernel and a group's ranks (``interactive/links.py``), and the kernel's
end of the agents' relay they ride on across nodes (``nodes/relay.py``): bytes in order per connection, a
closed connection said once, a command to many ranks leaving once per node, nothing taken after the group
formed. The end-to-end runs are in test_interactive_nodes.py and test_nodes_scale.py."""

from __future__ import annotations

import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from notebook_accel.interactive.links import RelayedLinks, SocketLinks
from notebook_accel.nodes import protocol as wire
from notebook_accel.nodes.relay import StreamEnds, StreamRelay
from tests.nodes_helpers import unix_listener


def _collect(links, want: int, timeout: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += links.wait(0.05)
    return got


@pytest.fixture
def local(tmp_path):
    path = str(tmp_path / "ranks.sock")
    links = SocketLinks(unix_listener(path, 8))
    yield links, path
    links.close()


def test_socket_links_take_connections_and_give_bytes_in_order_per_connection(local):
    links, path = local
    ranks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    try:
        for i, sock in enumerate(ranks):
            sock.connect(path)
            sock.sendall(f"hello {i}".encode())
        got = _collect(links, 3)
        assert sorted(data for _, data in got) == [b"hello 0", b"hello 1", b"hello 2"]
        keys = {data: key for key, data in got}
        # A frame to two of them: both receive it; the third nothing.
        targets = [keys[b"hello 0"], keys[b"hello 2"]]
        assert links.send(targets, b"cmd") == []
        for i in (0, 2):
            ranks[i].settimeout(10)
            assert ranks[i].recv(16) == b"cmd"
        ranks[1].sendall(b"a")
        ranks[1].sendall(b"b")
        ranks[1].close()
        later = b""
        deadline = time.monotonic() + 10
        while not later.endswith(b"|") and time.monotonic() < deadline:
            for key, data in links.wait(0.05):
                assert key is keys[b"hello 1"]
                later += data if data else b"|"  # the close, once, after the bytes
        assert later == b"ab|"
        # After the group formed, nobody else gets in.
        links.stop_accepting()
        with pytest.raises(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late:
            late.connect(path)
        links.close([keys[b"hello 0"]])
        ranks[0].settimeout(10)
        assert ranks[0].recv(16) == b""  # the rank sees its connection end
    finally:
        for sock in ranks:
            sock.close()


def test_socket_links_wait_on_descriptors_past_1024(tmp_path):
    """A kernel with a thousand ranks holds descriptors past 1024, which select.select refuses."""
    path = str(tmp_path / "high.sock")
    listener = unix_listener(path, 2)
    high = socket.socket(fileno=os.dup2(listener.fileno(), 1500))
    listener.close()
    links = SocketLinks(high)
    try:
        assert links.wait(0.01) == []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rank:
            rank.connect(path)
            rank.sendall(b"x")
            assert [data for _, data in _collect(links, 1)] == [b"x"]
    finally:
        links.close()


class _FakeRelay:
    """What ``RelayedLinks`` uses of ``StreamRelay``: open, send (one call per node), close_stream."""

    def __init__(self, lost: set[int] = frozenset()) -> None:
        self.ends: StreamEnds | None = None
        self.sent: list[tuple[int, list[int], bytes]] = []
        self.closed: list[tuple[int, int]] = []
        self.lost = set(lost)

    def open(self, ends: StreamEnds) -> str:
        self.ends = ends
        return "tok"

    def send(self, node: int, stream_ids: list[int], data: bytes) -> bool:
        self.sent.append((node, list(stream_ids), data))
        return node not in self.lost

    def close_stream(self, node: int, stream_id: int) -> None:
        self.closed.append((node, stream_id))


def test_relayed_links_queue_what_the_nodes_send_and_send_once_per_node():
    relay = _FakeRelay(lost={2})
    links = RelayedLinks(relay)
    assert links.token == "tok" and relay.ends is links
    for node, stream in [(0, 1), (0, 2), (1, 1), (2, 1)]:
        assert links.opened(node, stream)
    links.received(0, [(1, b"a"), (2, b"x"), (1, b"b")])
    links.received(1, [(1, b"y"), (1, b"")])
    links.received(3, [(9, b"never opened")])  # ignored
    assert links.wait(0) == [((0, 1), b"a"), ((0, 2), b"x"), ((0, 1), b"b"), ((1, 1), b"y"), ((1, 1), b"")]
    assert links.wait(0.01) == []
    # One message per node; a closed stream and a lost node's stream come back as not sent.
    failed = links.send([(0, 1), (0, 2), (1, 1), (2, 1)], b"cmd")
    assert relay.sent == [(0, [1, 2], b"cmd"), (2, [1], b"cmd")]
    assert sorted(failed) == [(1, 1), (2, 1)]
    links.received(1, [(1, b"after its close")])
    assert links.wait(0) == []
    links.stop_accepting()
    assert not links.opened(0, 3)
    links.close([(0, 2)])
    links.close()
    assert sorted(relay.closed) == [(0, 1), (0, 2), (2, 1)]


def test_relayed_links_wait_wakes_when_bytes_arrive():
    links = RelayedLinks(_FakeRelay())
    links.opened(0, 1)
    timer = threading.Timer(0.2, links.received, (0, [(1, b"late")]))
    start = time.monotonic()
    timer.start()
    assert links.wait(30) == [((0, 1), b"late")]
    assert time.monotonic() - start < 10  # woken by the bytes, not by the timeout


class _Ends(StreamEnds):
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.events: list = []

    def opened(self, node: int, stream_id: int) -> bool:
        self.events.append(("open", node, stream_id))
        return not self.refuse

    def received(self, node: int, chunks: list[tuple[int, bytes]]) -> None:
        self.events.append(("data", node, chunks))


def _group(n: int):
    sent: list = []
    nodes = [
        SimpleNamespace(index=i, host=f"n{i}", lost=None, send_quietly=lambda m, i=i: sent.append((i, m)))
        for i in range(n)
    ]
    return SimpleNamespace(nodes=nodes), sent


def test_the_kernels_relay_routes_each_stream_to_its_ends_and_closes_them_with_their_node():
    group, sent = _group(2)
    relay = StreamRelay(group)
    ends = _Ends()
    relay._ends["tok"] = ends  # what open() records once the agents listen
    for node in group.nodes:
        relay.on_message(node, wire.OpenStream("tok", 5))
    relay.on_message(group.nodes[0], wire.FromStreams([(5, b"a"), (6, b"unknown"), (5, b"b")]))
    assert relay.open_streams() == 2
    assert relay.send(1, [5], b"cmd") and sent[-1] == (1, wire.ToStreams([5], b"cmd"))
    relay.node_lost(group.nodes[1])
    relay.on_message(group.nodes[0], wire.CloseStream(5))
    assert ends.events == [
        ("open", 0, 5),
        ("open", 1, 5),
        ("data", 0, [(5, b"a"), (5, b"b")]),
        ("data", 1, [(5, b"")]),
        ("data", 0, [(5, b"")]),
    ]
    assert relay.open_streams() == 0
    # A stream of an unknown relay, or one its ends refuse, is closed on the agent's side at once.
    relay.on_message(group.nodes[0], wire.OpenStream("other", 7))
    refusing = relay._ends["tok2"] = _Ends(refuse=True)
    relay.on_message(group.nodes[1], wire.OpenStream("tok2", 8))
    assert sent[-2:] == [(0, wire.CloseStream(7)), (1, wire.CloseStream(8))]
    assert refusing.events == [("open", 1, 8)] and relay.open_streams() == 0
