"""Interactive ranks across machines, the parts that need no cluster: the magic's --nodes/--hosts options,
start_ranks(nodes=...)'s checks, and the rank's way home through its node's agent (the header a relayed
stream starts with, and which kernel sockets such a stream may reach), on real Unix sockets."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

from notebook_accel import Nodes
from notebook_accel.interactive import remote
from notebook_accel.interactive.magics import RanksMagic, RanksUsageError, nodes_option
from notebook_accel.interactive.session import Ranks, current, start_ranks
from notebook_accel.nodes import streams

# -- the magic's options ---------------------------------------------------------------------------


def test_hosts_and_nodes_forms() -> None:
    assert nodes_option(None, None, {}) is None
    assert nodes_option(None, "gpu-a, gpu-b", {}) == Nodes(hosts=("gpu-a", "gpu-b"), engine="ssh")
    assert nodes_option("slurm", None, {}) == Nodes(engine="slurm")
    assert nodes_option("slurm:4242", None, {}).job_id == "4242"
    mine = Nodes(hosts=["n1"], python="/opt/py/bin/python")
    # Even a variable named `slurm` does not shadow the literal form.
    assert nodes_option("cluster", None, {"cluster": mine, "slurm": mine}) is mine
    assert nodes_option("slurm", None, {"slurm": mine}) == Nodes(engine="slurm")


@pytest.mark.parametrize(
    ("nodes", "hosts", "ns", "match"),
    [
        ("slurm", "a,b", {}, r"--nodes slurm and --hosts a,b both say where the ranks run; give one"),
        (None, "a,,b", {}, r"--hosts 'a,,b': an empty host name; list hosts separated by commas"),
        (
            None,
            "a,-oProxyCommand=x",
            {},
            r"--hosts a,-oProxyCommand=x: .*'-oProxyCommand=x' is not a host name",
        ),
        (None, "a,a", {}, r"--hosts a,a: .*a listed more than once"),
        ("pbs:12", None, {}, r"--nodes pbs:12: nodes='pbs:12' is not one of the forms"),
        ("slurm:abc", None, {}, r"--nodes slurm:abc: .*abc"),
        ("cluster", None, {}, r"--nodes cluster: no such variable; give slurm, slurm:JOBID, or the name"),
        ("cluster", None, {"cluster": ["a"]}, r"--nodes cluster: a list, not a Nodes"),
    ],
)
def test_bad_nodes_options_are_refused(nodes, hosts, ns, match) -> None:
    with pytest.raises(RanksUsageError, match=match):
        nodes_option(nodes, hosts, ns)


def test_magic_refuses_bad_hosts_before_starting_anything() -> None:
    magic = RanksMagic(SimpleNamespace(user_ns={}))
    with pytest.raises(RanksUsageError, match=r"%ranks start --hosts ',gpu-b': an empty host name"):
        magic.line("start 2 --hosts ,gpu-b")
    with pytest.raises(RanksUsageError, match=r"%ranks start: argument --nodes: expected one argument"):
        magic.line("start 2 --nodes")
    assert current() is None


# -- start_ranks(nodes=...) ------------------------------------------------------------------------


def test_nodes_mean_spawned_ranks() -> None:
    assert remote.resolve_nodes(None, "fork") == (None, "fork")
    nodes, method = remote.resolve_nodes(["gpu-a"], "fork")
    assert nodes == Nodes(hosts=("gpu-a",)) and method == "spawn"
    assert remote.resolve_nodes("slurm", "spawn")[1] == "spawn"


def test_bad_nodes_refused_before_anything_starts() -> None:
    with pytest.raises(
        ValueError, match=r"start_method='forkserver' with nodes=: ranks on other machines always"
    ):
        start_ranks(2, nodes=["gpu-a"], start_method="forkserver")
    with pytest.raises(ValueError, match=r"nodes='pbs' is not one of the forms"):
        start_ranks(2, nodes="pbs")
    with pytest.raises(TypeError, match=r"nodes=3 \(a int\) is not one of the forms"):
        Ranks(2, nodes=3)
    assert current() is None


# -- the rank's way home through its node's agent ---------------------------------------------------


def test_connect_rank_directly_without_an_agent(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(remote.RELAY_ENV, raising=False)
    address = str(tmp_path / "k.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(address)
        listener.listen(1)
        sock = remote.connect_rank(address)
        conn = listener.accept()[0]
        sock.sendall(b"frame")
        assert conn.recv(16) == b"frame"  # no header: the same bytes as always on one machine
        sock.close()
        conn.close()


def test_connect_rank_through_the_agent_names_the_kernel_socket_first(tmp_path, monkeypatch) -> None:
    relay = str(tmp_path / "relay.sock")
    monkeypatch.setenv(remote.RELAY_ENV, relay)
    kernel_path = "/tmp/notebook_accel-ranks-x/ranks.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(relay)
        listener.listen(1)
        sock = remote.connect_rank(kernel_path)
        sock.sendall(b"first frame")
        sock.shutdown(socket.SHUT_WR)
        conn = listener.accept()[0]
        data = b""
        while chunk := conn.recv(7):
            data += chunk
        assert streams.read_target(data[:3]) is None and streams.read_target(data[:10]) is None
        assert streams.read_target(data) == (kernel_path, b"first frame")
        sock.close()
        conn.close()


def test_connect_rank_to_a_missing_relay_raises(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(remote.RELAY_ENV, str(tmp_path / "gone.sock"))
    with pytest.raises(FileNotFoundError):
        remote.connect_rank("/tmp/x.sock")


def test_a_header_no_rank_writes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"names a 0-byte path; expected 1..4096"):
        streams.read_target(b"\0\0\0\0rest")
    with pytest.raises(ValueError, match=r"names a 16777216-byte path"):
        streams.read_target(b"\x01\0\0\0rest")


def _listening(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(1)
    return sock


def test_relayed_streams_reach_only_interactive_ranks_sockets(tmp_path) -> None:
    folder = tempfile.mkdtemp(prefix=streams.FOLDER_PREFIX)  # as Ranks._start makes it: mode 0700
    ours = os.path.join(folder, "ranks.sock")
    elsewhere = str(tmp_path / "ranks.sock")
    plain = os.path.join(folder, "not-a-socket")
    open(plain, "w").close()
    sockets = [_listening(ours), _listening(elsewhere)]
    try:
        assert streams.check_target(ours) == os.path.realpath(ours)
        with pytest.raises(
            PermissionError, match=r"relayed stream to .* refused: only the socket of interactive"
        ):
            streams.check_target(elsewhere)
        with pytest.raises(PermissionError, match=r"only the socket of interactive ranks"):
            streams.check_target(plain)
        with pytest.raises(PermissionError, match=r"refused: No such file or directory"):
            streams.check_target(os.path.join(folder, "gone.sock"))
        os.chmod(folder, 0o755)  # a folder others may enter is not one start_ranks made
        with pytest.raises(PermissionError, match=r"only the socket of interactive ranks"):
            streams.check_target(ours)
    finally:
        for sock in sockets:
            sock.close()
        os.chmod(folder, 0o700)
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def test_header_round_trip_through_a_thread(tmp_path, monkeypatch) -> None:
    """The kernel side reads the header from whatever chunks the relay delivers."""
    relay = str(tmp_path / "relay.sock")
    monkeypatch.setenv(remote.RELAY_ENV, relay)
    got: list = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(relay)
        listener.listen(1)

        def serve() -> None:
            conn = listener.accept()[0]
            data = b""
            while (parsed := streams.read_target(data)) is None:
                data += conn.recv(1)  # one byte at a time: the worst a relay can split it
            got.append(parsed)
            conn.close()

        thread = threading.Thread(target=serve)
        thread.start()
        sock = remote.connect_rank("/tmp/notebook_accel-ranks-é/ranks.sock")
        sock.sendall(b"x")
        thread.join(10)
        sock.close()
    assert got == [("/tmp/notebook_accel-ranks-é/ranks.sock", b"")]


# -- the relay: real interactive ranks reaching the kernel through an agent's socket ----------------


def _joined() -> tuple[streams.AgentStreams, streams.KernelStreams]:
    """Return an agent end and a kernel end joined in this process (the channel between them left out)."""
    ends: list = []
    agent = streams.AgentStreams(lambda message: ends[0].handle(message))
    kernel = streams.KernelStreams(lambda message: agent.handle(message))
    ends.append(kernel)
    return agent, kernel


def test_interactive_ranks_work_unchanged_through_the_relay(monkeypatch) -> None:
    agent, kernel = _joined()
    # The ranks (forked from here) find the agent's socket where a node's agent puts it for its ranks.
    monkeypatch.setenv(remote.RELAY_ENV, agent.path)
    ranks = start_ranks(2, hang_timeout=30)
    try:
        assert len(kernel._socks) == 2 and len(agent._socks) == 2  # one relayed stream per rank
        assert ranks.run("rank * 10") == [0, 10]
        ranks.push("scale", 3)
        assert ranks.run("scale * (rank + 1)") == [3, 6]
        assert ranks.run(divmod, 7, 2) == [(3, 1), (3, 1)]  # a function and its arguments, by value
        ranks.execute(
            "import torch, torch.distributed as dist\nt = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)"
        )
        assert [t.tolist() for t in ranks.pull("t")] == [[3.0, 3.0], [3.0, 3.0]]
        assert ranks.run("rank", on=[1]) == [1]
        blob = bytes(range(256)) * 4096  # 1 MiB each way: more than one chunk of the relay
        ranks.push("blob", blob)
        assert ranks.run("len(blob) == 1 << 20 and blob[-1] == 255") == [True, True]
        with pytest.raises(Exception, match=r"raised on rank\(s\) \[1\].*alive"):
            ranks.execute("if rank == 1:\n    raise ValueError('only here')")
        assert ranks.run("rank") == [0, 1]
    finally:
        ranks.stop()
    deadline = time.monotonic() + 20
    while (kernel._socks or agent._socks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kernel._socks == {} and agent._socks == {}  # every stream closed with the ranks
    agent.close()
    assert not os.path.exists(agent.path)


def test_a_stream_naming_a_foreign_socket_is_closed_unconnected(tmp_path, caplog) -> None:
    agent, kernel = _joined()
    foreign = _listening(str(tmp_path / "other.sock"))
    foreign.settimeout(0.5)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(agent.path)
            sock.sendall(streams.pack_target(str(tmp_path / "other.sock")) + b"hello")
            assert sock.recv(16) == b""  # the stream is closed: nothing reached the other socket
        with pytest.raises(socket.timeout):
            foreign.accept()
        assert "a relayed stream from a node was refused" in caplog.text and "other.sock" in caplog.text
    finally:
        foreign.close()
        agent.close()
        kernel.close()


def test_either_end_closing_ends_the_other(tmp_path) -> None:
    agent, kernel = _joined()
    folder = tempfile.mkdtemp(prefix=streams.FOLDER_PREFIX)
    listener = _listening(os.path.join(folder, "ranks.sock"))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(agent.path)
            sock.sendall(streams.pack_target(os.path.join(folder, "ranks.sock")) + b"ping")
            listener.settimeout(20)
            conn = listener.accept()[0]
            conn.settimeout(20)
            assert conn.recv(4) == b"ping"
            conn.sendall(b"pong")
            assert sock.recv(4) == b"pong"
            conn.close()  # the kernel ends a rank's connection: the rank sees its end through the relay
            assert sock.recv(4) == b""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(agent.path)
            sock.sendall(streams.pack_target(os.path.join(folder, "ranks.sock")))
            conn = listener.accept()[0]
            conn.settimeout(20)
            # The channel to the node ended: each side closes its streams.
            kernel.close()
            assert conn.recv(4) == b""
            agent.close()
            assert sock.recv(4) == b""
            conn.close()
    finally:
        listener.close()
        agent.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_stream_messages_are_checked() -> None:
    kernel = streams.KernelStreams(lambda message: None)
    with pytest.raises(ValueError, match=r"not a stream message: 'exec'"):
        kernel.handle(("exec", 1))
