"""The kernel's side of a launch across many nodes, against simulated agents that speak the real protocol
(tests/nodes_sim.py): every line arrives, in order per rank; one empty command reaches every rank; one
``Start`` per node, one message per node for a command to all its ranks. The figures at 128 nodes x 8 ranks: benchmarks/bench_nodes_scale.py."""

from __future__ import annotations

import os
import threading
import time

from notebook_accel import notebook_launcher
from notebook_accel.interactive.session import start_ranks
from notebook_accel.nodes import protocol as wire
from tests.nodes_sim import SimPlacement, never_called

NODES, PER_NODE = 4, 4


def test_every_line_of_every_rank_arrives_in_order_across_simulated_nodes():
    placement = SimPlacement(NODES, per_host=2, rate=50, seconds=2.0)
    handle = notebook_launcher(never_called, num_processes=PER_NODE, nodes=placement, block=False, sinks=[])
    got: dict[int, list[str]] = {}
    lock = threading.Lock()

    def on_line(line):
        with lock:
            got.setdefault(line.rank, []).append(line.text)

    unsubscribe = handle.subscribe(on_line)
    try:
        assert handle.wait(120), "the simulated ranks did not end"
    finally:
        unsubscribe()
        handle.kill()
    assert handle.error is None
    assert handle.plan.hosts == tuple(f"sim{i}" for i in range(NODES))
    seen = {rank: lines for rank, lines in got.items()}
    for rank in range(NODES * PER_NODE):
        lines = [line for line in handle.lines(rank) if line.stream == "stdout"]
        assert [line.text for line in lines] == [f"r{rank} {i}" for i in range(100)], f"rank {rank}"
        assert seen.get(rank, [])[:100] == [f"r{rank} {i}" for i in range(100)]
    assert all(popen.wait(60) == 0 for popen in placement.hosts_started)


def test_one_start_message_per_node(monkeypatch):
    sent: list[type] = []
    real = wire.send

    def counting(channel, message):
        sent.append(type(message))
        real(channel, message)

    monkeypatch.setattr(wire, "send", counting)
    placement = SimPlacement(NODES, per_host=4, rate=0)
    handle = notebook_launcher(never_called, num_processes=PER_NODE, nodes=placement, block=False, sinks=[])
    try:
        deadline = time.monotonic() + 60
        while not all(s.pid for s in handle.status()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sent.count(wire.Start) == NODES
        # One thread reads the channels of up to 16 nodes (a selector), one sends the heartbeats: none per node.
        names = [t.name for t in threading.enumerate()]
        assert [name for name in names if name.startswith("notebook_accel-nodes-")] == ["notebook_accel-nodes-0"]
        assert names.count("notebook_accel-heartbeat") == 1
        assert not [name for name in names if name.startswith("notebook_accel-node-")]
    finally:
        handle.kill()
        handle.wait(60)


def test_an_empty_command_reaches_every_simulated_rank(monkeypatch):
    sent: list[wire.Message] = []
    real = wire.send

    def counting(channel, message):
        sent.append(message)
        real(channel, message)

    monkeypatch.setattr(wire, "send", counting)
    ranks = start_ranks(PER_NODE, nodes=SimPlacement(NODES, per_host=4, mode="interactive"))
    try:
        fds = len(os.listdir("/proc/self/fd"))
        threads = threading.active_count()
        sent.clear()
        results = ranks.execute("pass")
        assert [r.rank for r in results] == list(range(NODES * PER_NODE))
        assert all(r.ok for r in results)
        assert {s.node for s in ranks.handle.status()} == {f"sim{i}" for i in range(NODES)}
        # The command left once per node, for all the node's ranks (the agent copies it to each).
        commands = [m for m in sent if isinstance(m, wire.ToStreams)]
        assert len(commands) == NODES and all(len(m.stream_ids) == PER_NODE for m in commands)
        # The kernel holds nothing per rank for the command: no socket, no relay thread (a slow command on a
        # loaded machine may have the hang rule's one sampling thread running).
        assert len(os.listdir("/proc/self/fd")) - fds <= 1 and threading.active_count() - threads <= 1
        assert not [t for t in threading.enumerate() if t.name.startswith("notebook_accel-relay")]
    finally:
        ranks.stop()
