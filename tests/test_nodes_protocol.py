"""The kernel <-> agent wire (``nodes/protocol.py``): every message round-trips, a version mismatch names both
versions, an unknown or misdirected message is refused; and Unix sockets bind under a deep TMPDIR."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading

import pytest

from notebook_accel.nodes import protocol as wire
from notebook_accel.nodes.channel import accept_channel, connect_channel, new_secret
from notebook_accel.utils import _wire

SAMPLES: list[wire.Message] = [
    wire.Heartbeat(),
    wire.ToStreams([3, 5], b"\x00bytes"),
    wire.FromStreams([(3, b"\x00a"), (5, b"b"), (3, b"c")]),
    wire.CloseStream(3),
    wire.Start(7, ["/a", "/b"], [wire.RankStart(11, {"rank": 0}), wire.RankStart(12, {"rank": 1})]),
    wire.Signal(11, 15),
    wire.StackRequest(8, [11, 12]),
    wire.Listen("tok"),
    wire.End(),
    wire.Hello(wire.PROTOCOL_VERSION, 2, {"python": "3.11"}, {"host": "n3", "pid": 5, "gpus": 0}),
    wire.Started(7, {11: 100}, {12: "OSError: no"}),
    wire.Output([wire.Chunk(11, "stdout", b"a\n"), wire.Chunk(12, "result", b"\x01")]),
    wire.Eof(11, "stderr"),
    wire.Exited(11, -9),
    wire.Usage({0: {"cpu_percent": 1.0, "rss": 2, "peak_rss": 3}}),
    wire.Stacks(8, {0: "a RankStack"}),
    wire.Listening("tok", "/tmp/x/s"),
    wire.OpenStream("tok", 4),
]


def test_the_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(wire.TO_AGENT) | set(wire.TO_KERNEL)
    assert len(wire.MESSAGES) == len(set(wire.TO_AGENT) | set(wire.TO_KERNEL))  # one kind per type


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_a_real_channel(message):
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0))
    got: list = []

    def agent_side():
        channel = connect_channel(server.getsockname(), secret)
        got.append(channel)

    thread = threading.Thread(target=agent_side)
    thread.start()
    conn, _ = server.accept()
    kernel = accept_channel(conn, secret)
    thread.join()
    agent = got[0]
    try:
        if type(message) in wire.TO_AGENT:
            wire.send(kernel, message)
            assert wire.receive(agent, wire.TO_AGENT) == message
        if type(message) in wire.TO_KERNEL:
            wire.send(agent, message)
            assert wire.receive(kernel, wire.TO_KERNEL) == message
    finally:
        kernel.close()
        agent.close()
        server.close()


def test_a_hello_of_another_version_is_refused_naming_both_versions():
    body = pickle.dumps(("hello", 99, 1, {}, {}))
    with pytest.raises(
        wire.ProtocolVersionError,
        match=rf"the agent of node 1 speaks version 99 .* this side speaks version {wire.PROTOCOL_VERSION}.*"
        r"Install the same notebook_accel version",
    ):
        wire.decode(body, wire.TO_KERNEL)


def test_an_unknown_message_type_is_refused():
    with pytest.raises(wire.ProtocolError, match=r"unknown message type 'launch_missiles'.* has hb, start"):
        wire.decode(pickle.dumps(("launch_missiles", 1)), wire.TO_AGENT)
    with pytest.raises(wire.ProtocolError, match="not a message of the kernel<->agent protocol"):
        wire.decode(pickle.dumps(["start"]), wire.TO_AGENT)


def test_a_message_of_the_other_direction_or_shape_is_refused():
    with pytest.raises(
        wire.ProtocolError, match=r"a 'start' message is not expected here \(expected hb, hello"
    ):
        wire.decode(wire.encode(next(m for m in SAMPLES if isinstance(m, wire.Start))), wire.TO_KERNEL)
    with pytest.raises(
        wire.ProtocolError, match=r"a 'signal' message came with 1 field\(s\).* 2 \(wid, signum\)"
    ):
        wire.decode(pickle.dumps(("signal", 11)), wire.TO_AGENT)


def test_an_agent_refuses_a_kernel_of_another_version_before_connecting():
    boot = {"address": "127.0.0.1", "port": 9, "secret": new_secret().hex(), "node": 0, "heartbeat": 1.0,
            "protocol": wire.PROTOCOL_VERSION + 1}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "notebook_accel.nodes.agent"],
        input=(json.dumps(boot) + "\n").encode(),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert (
        f"the kernel speaks version {wire.PROTOCOL_VERSION + 1} of the kernel<->agent protocol and this side "
        f"speaks version {wire.PROTOCOL_VERSION}"
    ) in done.stderr.decode()


def test_the_kernel_and_agent_sides_import_the_protocol_not_each_other():
    import ast
    import pathlib

    nodes = pathlib.Path(wire.__file__).parent
    for name in ("remote.py", "relay.py", "workers.py"):
        tree = ast.parse((nodes / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "agent" not in imported, f"nodes/{name} imports the agent's module"
    agent = ast.parse((nodes / "agent.py").read_text())
    imported = {node.module for node in ast.walk(agent) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"remote", "relay", "workers"}


# ------------------------------------------------------------------ Unix sockets under a deep TMPDIR


def test_a_unix_socket_binds_even_when_tmpdir_is_too_deep(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    path = _wire.unix_socket_path("notebook_accel-relay-")
    try:
        assert len(os.fsencode(path)) <= _wire.UNIX_PATH_MAX
        assert not path.startswith(str(deep))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(path)
        assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"  # private, as mkdtemp makes it
    finally:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


def test_a_short_tmpdir_is_used_as_is(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    path = _wire.unix_socket_path("x-", "ranks.sock")
    assert path.startswith(str(tmp_path)) and path.endswith("/ranks.sock")


def test_no_place_for_a_socket_is_a_clear_error(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setattr(_wire, "_SHORT_BASE", str(deep))
    with pytest.raises(OSError, match=r"TMPDIR='.*d{120}' makes its path longer than 107 bytes.* set TMPDIR"):
        _wire.unix_socket_path("notebook_accel-ranks-")


def test_usage_figures_are_sent_when_they_change_visibly_and_all_every_refresh():
    changes = wire.UsageChanges()
    idle = {"cpu_percent": 0.0, "rss": 100 << 20, "peak_rss": 100 << 20}
    assert changes.select({0: idle, 1: idle}, now=0.0) == {0: idle, 1: idle}  # the first: all
    assert changes.select({0: {**idle, "rss": (100 << 20) + 4096}, 1: idle}, now=1.0) == {}  # a page: not shown
    busy = {**idle, "cpu_percent": 97.0}
    assert changes.select({0: busy, 1: idle}, now=2.0) == {0: busy}
    assert changes.select({0: busy, 1: idle}, now=wire.USAGE_REFRESH) == {0: busy, 1: idle}
