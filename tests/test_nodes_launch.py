"""notebook_launcher(..., nodes=...) end to end: two "nodes" (agents as real processes here) x two ranks.

The test placement (tests/nodes_helpers.py) starts each agent with plain subprocess on this machine,
so the rendezvous runs on 127.0.0.1; everything else (agents, channel, remote ranks, the handle) is
the real thing. Each launch costs a few fresh interpreters: the tests are few and do several checks each.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from notebook_accel import notebook_launcher
from notebook_accel.launch.errors import LaunchError
from notebook_accel.launch.output import OutputLine
from notebook_accel.nodes import channel as channel_mod
from notebook_accel.nodes import remote
from notebook_accel.nodes.remote import NodeGroup, NodeJoinError, NodeSettings
from tests.nodes_helpers import LocalPlacement


def world():
    """Each rank: the world PartialState sees, and an all_reduce over every node."""
    import torch
    import torch.distributed as dist

    from notebook_accel import PartialState

    state = PartialState()
    total = torch.tensor([float(state.process_index)])
    dist.all_reduce(total)
    print(
        f"rank {state.process_index} of {state.num_processes} on node {os.environ['NODE_RANK']}", flush=True
    )
    return {
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "local_process_index": state.local_process_index,
        "is_local_main_process": state.is_local_main_process,
        "is_main_process": state.is_main_process,
        "env": {
            k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        },
        "sum": float(total),
    }


def wait_here(seconds):
    """Each rank: announce itself, then sit in an easily recognised frame."""
    print(f"waiting on rank {os.environ['RANK']}", flush=True)
    time.sleep(seconds)
    return "woke"


def test_two_nodes_two_ranks_each_form_one_world_with_labelled_output():
    lines: list[OutputLine] = []
    results = notebook_launcher(
        world, num_processes=2, nodes=LocalPlacement(("n1", "n2")), sinks=[lines.append]
    )
    assert [r["process_index"] for r in results] == [0, 1, 2, 3]
    for rank, r in enumerate(results):
        assert r["num_processes"] == 4 and r["sum"] == 6.0
        assert r["local_process_index"] == rank % 2
        assert r["is_local_main_process"] == (rank % 2 == 0)
        assert r["is_main_process"] == (rank == 0)
        assert r["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "NODE_RANK": str(rank // 2),
                            "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
    said = {line.rank: line.text for line in lines if line.text.startswith("rank ")}
    assert said == {r: f"rank {r} of 4 on node {r // 2}" for r in range(4)}


def test_live_handle_labels_nodes_takes_remote_stacks_and_stops(monkeypatch, capsys):
    secrets_made = []
    real_new_secret = channel_mod.new_secret

    def recording_secret():
        secrets_made.append(real_new_secret())
        return secrets_made[-1]

    monkeypatch.setattr(remote, "new_secret", recording_secret)
    placement = LocalPlacement(("n1", "n2"))
    handle = notebook_launcher(wait_here, args=(300,), num_processes=2, nodes=placement, block=False)
    try:
        deadline = time.monotonic() + 120
        while sum("waiting on rank" in line.text for line in handle.lines()) < 4:
            assert time.monotonic() < deadline, handle.lines()
            time.sleep(0.2)
        assert [s.node for s in handle.status()] == ["n1", "n1", "n2", "n2"]
        assert all(s.state == "running" for s in handle.status())
        # The secret is on no command line of any process of this machine (kernel, agents, ranks).
        (secret,) = secrets_made
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            assert secret.hex() not in cmdline and repr(secret) not in cmdline
        # A rank on a loaded machine may miss the one second it gets to dump: ask again (never more than 5 times).
        for _ in range(5):
            stacks = handle.stacks()
            if all(stack.answered for stack in stacks.values()):
                break
        assert sorted(stacks) == [0, 1, 2, 3]
        for stack in stacks.values():
            assert stack.answered and "wait_here" in stack.text, stack.summary()
        deadline = time.monotonic() + 60  # the agents sample about once a second
        while not all(s.rss and s.rss > 10_000_000 for s in handle.status()):
            assert time.monotonic() < deadline, handle.status()
            time.sleep(0.2)
        started = time.monotonic()
        handle.stop()
        handle.wait(60)
        assert time.monotonic() - started < 30  # generous: the goal (< 5 s) is a benchmark's business
    finally:
        handle.kill()
        handle.wait(60)
    assert all(s.state == "stopped" for s in handle.status())
    printed = capsys.readouterr().out
    assert "[n2 rank 3] waiting on rank 3" in printed and "[n1 rank 0] waiting on rank 0" in printed
    for proc in placement.popens:  # the agents ended with the launch (by themselves, or stopped when slow)
        assert proc.wait(30) is not None
    for pid in handle.pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_killed_agent_stops_every_rank_and_names_its_node():
    placement = LocalPlacement(("n1", "n2"), heartbeat=0.5)
    handle = notebook_launcher(
        wait_here, args=(300,), num_processes=2, nodes=placement, block=False, sinks=[]
    )
    try:
        deadline = time.monotonic() + 120
        while sum("waiting on rank" in line.text for line in handle.lines()) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        pids = list(handle.pids)
        placement.popens[1].send_signal(signal.SIGKILL)
        assert handle.wait(60)
    finally:
        handle.kill()
        handle.wait(60)
    error = handle.error
    assert isinstance(error, LaunchError)
    assert "node n2 (node 1) was lost" in str(error)
    assert {s.state for s in handle.status()} <= {"failed", "stopped"}
    deadline = time.monotonic() + 30
    while any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids
    ):
        assert time.monotonic() < deadline, "a rank outlived the launch"
        time.sleep(0.2)


def test_versions_that_differ_are_refused_before_any_rank_starts(monkeypatch):
    kernel_versions = {**remote.local_versions(), "torch": "0.0.1-kernel"}
    monkeypatch.setattr(remote, "local_versions", lambda: kernel_versions)
    placement = LocalPlacement(("n1", "n2"))
    with pytest.raises(
        NodeJoinError,
        match=r"node n[12] \(node [01]\) runs other versions than this kernel: torch .* there, 0.0.1-kernel here",
    ):
        NodeGroup.join(placement, NodeSettings.of(placement.nodes))
    assert all(proc.wait(30) is not None for proc in placement.popens)


def test_a_node_that_never_joins_is_named_with_the_engines_message():
    import sys

    failing = [
        sys.executable,
        "-c",
        "import sys; sys.stderr.write('ssh: connect to host n2: Connection refused'); sys.exit(255)",
    ]
    placement = LocalPlacement(("n1", "n2"), argv_for=lambda i: failing if i == 1 else None)
    with pytest.raises(
        NodeJoinError, match=r"node n2 \(node 1\) did not join the launch: .*Connection refused"
    ):
        notebook_launcher(world, num_processes=1, nodes=placement)
    assert placement.popens[0].wait(30) is not None  # the node that did start ended too


def test_a_node_silent_past_the_join_timeout_is_named():
    import sys

    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    placement = LocalPlacement(("n1",), join_timeout=2.0, argv_for=lambda i: silent)
    with pytest.raises(
        NodeJoinError,
        match=r"node n1 \(node 0\) did not join the launch: it did not join within join_timeout=2 s",
    ):
        NodeGroup.join(placement, NodeSettings.of(placement.nodes))
    assert placement.popens[0].poll() is not None


@pytest.mark.parametrize(
    ("option", "value"), [("num_nodes", 2), ("node_rank", 1), ("master_addr", "10.1.2.3")]
)
def test_nodes_refuses_the_torchrun_way_options(option, value):
    with pytest.raises(ValueError, match=rf"{option}=.* cannot be combined with nodes=.*leave {option} at"):
        notebook_launcher(world, nodes=["a", "b"], **{option: value})


def fail_once_on_rank_3(marker_dir):
    """Rank 3 fails on the first attempt only."""
    marker = os.path.join(marker_dir, "failed-once")
    if os.environ["RANK"] == "3" and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("rank 3 fails on the first attempt")
    return (int(os.environ["RANK"]), os.getppid())


def test_max_restarts_restarts_every_node_through_the_same_agents(tmp_path):
    placement = LocalPlacement(("n1", "n2"))
    results = notebook_launcher(
        fail_once_on_rank_3, args=(str(tmp_path),), num_processes=2, nodes=placement, max_restarts=1, sinks=[]
    )
    assert [rank for rank, _ in results] == [0, 1, 2, 3]
    agents = [p.pid for p in placement.popens]
    assert len(agents) == 2  # no new agent for the second attempt
    assert [parent for _, parent in results] == [agents[0], agents[0], agents[1], agents[1]]


def barrier_on_rank_0():
    """Rank 0 waits in a barrier the others never reach: a hang."""
    import torch.distributed as dist

    from notebook_accel import PartialState

    state = PartialState()
    print(f"joined {state.process_index}", flush=True)
    if state.process_index == 0:
        dist.barrier()
    else:
        time.sleep(300)


def test_the_hang_report_holds_the_stacks_of_ranks_on_every_node():
    placement = LocalPlacement(("n1", "n2"))
    handle = notebook_launcher(
        barrier_on_rank_0,
        num_processes=1,
        nodes=placement,
        block=False,
        sinks=[],
        hang_timeout=2.0,
        on_hang="stop",
    )
    try:
        assert handle.wait(240), "the hang was not reported"
    finally:
        handle.kill()
        handle.wait(60)
    report = handle.hang_report
    assert report is not None and report.startswith("rank 0 (n1) in barrier (for "), report
    assert "while rank(s) 1 (n2) are busy" in report  # honest work, as far as stacks can tell
    assert 'on_hang="stop" stops the launch at this report' in report
    assert "  rank 0 (n1): in barrier" in report and "  rank 1 (n2): in barrier_on_rank_0 at" in report
    assert re.search(r"Stacks of rank 1 \(pid \d+, on n2\):", report) and "barrier_on_rank_0" in report
    assert "Stacks of rank 0" not in report  # the waiting rank's position says it all; the busy ones' stacks
    error = str(handle.error)
    assert error.startswith('launch stopped: at the hang report (on_hang="stop"): rank 0 (n1) in barrier'), (
        error
    )
    assert re.search(r"Stacks of rank 0 \(pid \d+, on n1\)", error) and "Stacks of rank 1 (pid" in error


def test_a_kernel_behind_in_reading_its_nodes_loses_none_of_them(monkeypatch):
    """The kernel's reader held up for 8 heartbeats (its process starved, a long call holding the interpreter):
    the nodes' beats wait unread meanwhile, which is not silence, so no node is lost and the run ends well."""
    from notebook_accel.nodes import protocol as wire

    dispatch, held = NodeGroup._dispatch, []

    def held_up_once(self, node, message):
        if isinstance(message, wire.Heartbeat) and not held and self.nodes[0].procs:  # the ranks are started
            held.append(node.host)
            time.sleep(8 * 0.5)  # past LOST_AFTER (5) heartbeats of 0.5 s
        dispatch(self, node, message)

    monkeypatch.setattr(NodeGroup, "_dispatch", held_up_once)
    results = notebook_launcher(
        wait_here, args=(6,), num_processes=1, nodes=LocalPlacement(("n1", "n2"), heartbeat=0.5), sinks=[]
    )
    assert held and results == ["woke", "woke"]


def test_a_silent_node_is_lost_by_heartbeat_and_its_agent_ends_its_ranks_later():
    """A partition as the kernel sees it: the agent frozen (no connection closes) is lost after 5
    heartbeats and the other node's ranks are stopped. (The agent's side of a partition, a kernel gone
    silent, is test_nodes_agent's.)"""
    placement = LocalPlacement(("n1", "n2"), heartbeat=0.5)
    handle = notebook_launcher(
        wait_here, args=(300,), num_processes=1, nodes=placement, block=False, sinks=[]
    )
    frozen = placement.popens[1]
    try:
        deadline = time.monotonic() + 120
        while sum("waiting on rank" in line.text for line in handle.lines()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        remote_rank = handle.pids[1]
        frozen.send_signal(signal.SIGSTOP)
        assert handle.wait(60)
    finally:
        frozen.send_signal(signal.SIGCONT)
        handle.kill()
        handle.wait(60)
    assert "node n2 (node 1) was lost: no heartbeat from its agent" in str(handle.error)
    assert handle.status()[1].state == "failed" and handle.status()[0].state in ("stopped", "failed")
    assert frozen.wait(60) is not None  # the kernel ended the engine's process of a lost node
    deadline = time.monotonic() + 10
    while psutil.pid_exists(remote_rank) and psutil.Process(remote_rank).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the frozen node's rank outlived its agent"
        time.sleep(0.1)
