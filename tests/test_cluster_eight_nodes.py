"""Sixteen ranks on eight nodes of the namespace cluster (2 per node): a launch, its output, an interactive
cell, a node lost; over Slurm (``nodes="slurm"`` inside an allocation of the 8 nodes) and over SSH.

The cluster (``ns_cluster8``, tests/ns_cluster.py) is built once per run, only when these tests are
selected; every start of 16 ranks costs 16 fresh interpreters importing torch on this machine, so each
engine has two: one ``notebook_launcher`` (the world, the results, the output) and one interactive group in
a real kernel (a cell across the 16 ranks, then a node lost while a cell runs). Times are printed (``-s``)
and asserted only with generous bounds: the machine is shared.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from notebook_accel import Nodes, notebook_launcher
from tests.launcher_helpers import label_ranks, wait_until
from tests.test_interactive_ipython import _cell
from tests.test_launcher_kernel import Kernel

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

PER_NODE = 2
WORLD = 16
LINES = 3  # lines each rank prints of its own, before the one every rank prints alike
GENEROUS = 120.0  # seconds: a bound for a loaded, shared 2-core machine, far above what it takes
# Held this long for the other ranks, a line all 16 print goes out as one line however loaded the machine
# is (it goes out as soon as the 16th copy arrives); what only one rank prints waits for the end at most.
WINDOW = 30.0
_LABEL = re.compile(r"^\[(?P<nodes>\S+) (?:rank|ranks) (?P<ranks>[\d,\-]+)\] (?P<text>.*)$")


def node_of(rank: int) -> str:
    return f"n{rank // PER_NODE + 1}"


def sixteen(lines: int) -> dict:
    """Each rank: lines of its own, an all_reduce over every node, a line every rank prints alike."""
    import torch
    import torch.distributed as dist

    from notebook_accel import PartialState

    state = PartialState()
    # The address this process has on the route to the kernel: its node's, proof of where it runs.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ["MASTER_ADDR"], 9))
        address = probe.getsockname()[0]
    for step in range(lines):
        print(f"rank {state.process_index} says {step}", flush=True)
    total = torch.tensor([float(state.process_index + 1)])
    dist.all_reduce(total)
    print(f"all reduced to {total.item():g} across {state.num_processes} ranks", flush=True)
    return {
        "rank": state.process_index,
        "world": state.num_processes,
        "local": state.local_process_index,
        "node_rank": int(os.environ["NODE_RANK"]),
        "address": address,
        "sum": total.item(),
    }


def _ours(cluster, nodes=None) -> dict[str, list[int]]:
    """Return the processes of ours (agents, ranks, steps, ssh sessions) still on each node."""
    return {node: cluster.workload_pids(node) for node in nodes or cluster.nodes}


def _none_left(cluster, nodes=None) -> bool:
    return not any(_ours(cluster, nodes).values())


@pytest.fixture(scope="module")
def allocation(ns_cluster8):
    job_id = ns_cluster8.allocate(8)
    yield job_id
    ns_cluster8.release(job_id)


@pytest.fixture()
def inside(ns_cluster8, allocation, monkeypatch):
    """This process inside the allocation of the 8 nodes, as salloc's shell (or a Jupyter in it) is."""
    for key, value in ns_cluster8.allocation_env(allocation).items():
        monkeypatch.setenv(key, value)


@pytest.fixture()
def clean(ns_cluster8):
    """Wait until nothing of an earlier test runs on any node; afterwards, until nothing of this one does."""
    wait_until(lambda: _none_left(ns_cluster8), GENEROUS, "processes of an earlier test ended")
    ports = {node: ns_cluster8.listening(node) for node in ns_cluster8.nodes}
    yield ports
    wait_until(lambda: _none_left(ns_cluster8), GENEROUS, "every agent and rank ended")


@pytest.fixture()
def node_tmp():
    """A folder for the nodes' temporary files, with a short path: the Unix sockets made there must fit
    in 108 bytes (under pytest's ``tmp_path``, ``start_ranks`` fails: "AF_UNIX path too long")."""
    folder = Path(tempfile.mkdtemp(prefix="nac8-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _nodes_for(engine: str, cluster, tmp: Path, monkeypatch) -> Nodes | str:
    """Return the ``nodes=`` of ``engine``, the nodes' temporary files going to ``tmp``."""
    if engine == "slurm":
        monkeypatch.setenv("TMPDIR", str(tmp))  # srun carries this process's environment to the nodes
        return "slurm"  # the allocation this process runs in (``inside``)
    # A beat every 5 s (lost after 25 s): in a clean-clone CI run the 16 ranks starting on the 2 cores the
    # suite shares (JupyterLab and a browser starting beside them) starved all eight agents for 11 s.
    return Nodes(hosts=cluster.nodes, ssh_options=cluster.ssh_options, env={"TMPDIR": str(tmp)}, heartbeat=5.0)


def _printed(out: str) -> list[tuple[str, list[int], str]]:
    """Return ``(nodes, ranks, text)`` of each labelled line printed (``[n5 rank 9] x``: ("n5", [9], "x"))."""
    found = []
    for line in out.splitlines():
        match = _LABEL.match(line)
        if match is not None:
            found.append((match["nodes"], label_ranks(match["ranks"]), match["text"]))
    return found


@pytest.mark.parametrize("engine", ["slurm", "ssh"])
def test_sixteen_ranks_on_eight_nodes_form_one_world_and_their_output_is_labelled_and_collapsed(
    ns_cluster8, inside, clean, engine, node_tmp, capsys, monkeypatch
) -> None:
    nodes = _nodes_for(engine, ns_cluster8, node_tmp, monkeypatch)
    started = time.monotonic()
    handle = notebook_launcher(
        sixteen, args=(LINES,), num_processes=PER_NODE, nodes=nodes, block=False, collapse_output=WINDOW
    )
    try:
        first = wait_until(lambda: len(handle.lines()) > 0, GENEROUS, "a first line from a rank")
        results = handle.result(timeout=GENEROUS)
        done = time.monotonic() - started
    finally:
        handle.kill()
        handle.wait(60)
    with capsys.disabled():
        print(f"\n[{engine}] launch of 16 ranks on 8 nodes: first line {first:.1f} s, results {done:.1f} s")
    # One world of 16: every rank knows its place, ran on its node (the node's own address), and reduced.
    assert [r["rank"] for r in results] == list(range(WORLD))
    for rank, r in enumerate(results):
        assert (r["world"], r["local"], r["node_rank"]) == (WORLD, rank % PER_NODE, rank // PER_NODE)
        assert r["address"] == ns_cluster8.addresses[node_of(rank)], (rank, r)
        assert r["sum"] == WORLD * (WORLD + 1) / 2
    assert {s.rank: s.node for s in handle.status()} == {r: node_of(r) for r in range(WORLD)}
    # The cell: each rank's own lines labelled with its node, in order; the shared line once, for all 16.
    printed = _printed(capsys.readouterr().out)
    shared = f"all reduced to {WORLD * (WORLD + 1) // 2} across {WORLD} ranks"
    assert [p for p in printed if p[2] == shared] == [("n1-n8", list(range(WORLD)), shared)], printed
    for rank in range(WORLD):
        own = [(nodes_, text) for nodes_, ranks, text in printed if ranks == [rank]]
        assert own == [(node_of(rank), f"rank {rank} says {step}") for step in range(LINES)], own
    assert len(printed) == WORLD * LINES + 1, printed
    # The history keeps every rank's copy of every line.
    for rank in range(WORLD):
        assert [ln.text for ln in handle.lines(rank) if ln.stream == "stdout"] == [
            *(f"rank {rank} says {step}" for step in range(LINES)),
            shared,
        ]
    # Nothing is left on any node: no process, no listening port, no temporary file.
    wait_until(lambda: _none_left(ns_cluster8), GENEROUS, "every agent and rank ended")
    assert {node: ns_cluster8.listening(node) for node in ns_cluster8.nodes} == clean
    assert sorted(p.name for p in node_tmp.iterdir()) == []


def _ok(kernel: Kernel, code: str, timeout: float = GENEROUS) -> str:
    status, out, err, _ = kernel.run(code, timeout=timeout)
    assert status == "ok", (out, err)
    return out


REDUCE = """%%ranks
import torch, torch.distributed as dist
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
print("reduced to", t.item(), "across", world_size, "ranks")
t.item()
"""
SLEEP = """%%ranks
import pathlib, time
print("sleeping", flush=True)
pathlib.Path({folder!r}, str(rank)).touch()
time.sleep(600)
"""
REASONS = {"kill_node": "the connection to its agent closed", "link_down": "no heartbeat from its agent"}


def _strike_when(sleeping: Path, fault) -> float | None:
    """Call ``fault()`` once every rank has marked ``sleeping``; return when (None: not within GENEROUS s)."""
    deadline = time.monotonic() + GENEROUS
    while len(list(sleeping.iterdir())) < WORLD:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    fault()
    return time.monotonic()


def _start_and_reduce(kernel: Kernel, where: str) -> tuple[float, float]:
    """Start 2 ranks on each node with ``%ranks start``, run a reducing cell; return both times."""
    started = time.monotonic()
    _ok(kernel, f"%ranks start {PER_NODE} --nodes {where} --collapse-output {WINDOW:g}", 2 * GENEROUS)
    up = time.monotonic() - started
    out, shown, error = _cell(kernel, REDUCE, GENEROUS)
    assert error is None, error
    cell = time.monotonic() - started - up
    total = WORLD * (WORLD + 1) / 2
    shared = f"reduced to {total} across {WORLD} ranks"
    assert [p for p in _printed(out) if p[2] == shared] == [("n1-n8", list(range(WORLD)), shared)], out
    values = [bundle["data"].get("text/plain", "") for bundle in shown]
    assert values == [f"[all {WORLD} ranks] {total}"], values  # the cell's value, alike on every rank
    out = _ok(kernel, "print({s.rank: s.node for s in interactive.current().status()})")
    assert out.strip() == repr({r: node_of(r) for r in range(WORLD)}), out
    return up, cell


@pytest.mark.parametrize(
    ("engine", "lost", "fault"),
    [("slurm", "n5", "kill_node"), ("ssh", "n8", "link_down")],
    ids=["slurm-node-killed", "ssh-node-cut-off"],
)
def test_a_cell_across_sixteen_ranks_on_eight_nodes_then_a_node_lost(
    ns_cluster8, inside, clean, engine, lost, fault, node_tmp, tmp_path, capsys, monkeypatch
) -> None:
    """``%ranks start 2 --nodes ...`` in a real kernel; a reducing cell; then ``lost`` crashes or is cut off mid-cell.

    The kernel runs inside the allocation (``inside``: started with its variables, as a Jupyter started by
    salloc is). Killed (``kill_node``: its daemons, agent and ranks at once), the node's connection closes;
    cut off (``link_down``: nothing closes), its heartbeats stop and its agent ends its own ranks.
    """
    cluster = ns_cluster8
    survivors = [node for node in cluster.nodes if node != lost]
    struck: list[float | None] = []  # when the fault was made (the node is revived or reconnected at the end)
    if engine == "slurm":  # srun carries the kernel's environment to the agents and ranks
        monkeypatch.setenv("TMPDIR", str(node_tmp))
    kernel = Kernel()
    try:
        _ok(
            kernel,
            f"""
            %load_ext notebook_accel
            from notebook_accel import Nodes, interactive
            cluster = Nodes(hosts={list(cluster.nodes)!r}, ssh_options={list(cluster.ssh_options)!r},
                            env={{"TMPDIR": {str(node_tmp)!r}}}, heartbeat=1.0)
            """,
        )
        up, cell = _start_and_reduce(kernel, "slurm" if engine == "slurm" else "cluster")
        # The node is lost while every rank sleeps in a cell: the cell ends with an error naming it.
        sleeping = tmp_path / "sleeping"
        sleeping.mkdir()
        strike = threading.Thread(
            target=lambda: struck.append(_strike_when(sleeping, lambda: getattr(cluster, fault)(lost)))
        )
        strike.start()
        try:
            status, out, err, _ = kernel.run(SLEEP.format(folder=str(sleeping)), timeout=2 * GENEROUS)
            ended = time.monotonic()
        finally:
            strike.join()
        assert struck and struck[0] is not None, "every rank was sleeping: the fault was never made"
        noticed = ended - struck[0]
        assert f"[n1-n8 ranks 0-{WORLD - 1}] sleeping" in out.splitlines(), out
        with capsys.disabled():
            print(
                f"\n[{engine}] %ranks start of 16 ranks on 8 nodes {up:.1f} s, reducing cell {cell:.1f} s; "
                f"{fault}({lost}) -> cell error in {noticed:.1f} s"
            )
        assert status == "error" and noticed < GENEROUS, (status, out, err)
        assert f"node {lost} (node {cluster.nodes.index(lost)}) was lost: {REASONS[fault]}" in err, err
        for rank in (r for r in range(WORLD) if node_of(r) == lost):
            assert re.search(rf"rank {rank} \(pid \d+, on {lost}\)", err), err
        assert _ok(kernel, "print(interactive.current().alive)").strip() == "False"
        _ok(kernel, "%ranks stop")
        wait_until(
            lambda: _none_left(cluster, survivors), GENEROUS, "the other nodes' agents and ranks ended"
        )
        assert {node: cluster.listening(node) for node in survivors} == {n: clean[n] for n in survivors}
        if fault == "link_down":
            # Cut off, the node heard nothing from the kernel either: its agent ended its ranks, then itself.
            wait_until(lambda: not cluster.python_pids(lost), GENEROUS, f"{lost}'s agent ended its ranks")
            cluster.link_up(lost)
            assert cluster.listening(lost) == clean[lost]
            # Every node ended cleanly (none crashed): no temporary file is left either.
            assert sorted(p.name for p in node_tmp.iterdir()) == []
        else:
            # A crash leaves the node's temporary files (on a real node, in its own /tmp); each other
            # node's went with its agent: no kind of folder is left more than once (one node's worth).
            left = collections.Counter(p.name.rsplit("-", 1)[0] for p in node_tmp.iterdir())
            assert all(count == 1 for count in left.values()), left
    finally:
        kernel.run("interactive.current() and interactive.current().stop()", timeout=GENEROUS)
        kernel.close()
        if struck and struck[0] is not None:
            cluster.link_up(lost) if fault == "link_down" else cluster.revive(lost)
