"""Interactive ranks across machines, the parts that need no cluster: the magic's --nodes/--hosts options,
start_ranks(nodes=...)'s checks, and the rank's way home (directly, or through its node's relay socket),
on real Unix sockets. Ranks across the namespace cluster: tests/test_interactive_cluster.py."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from notebook_accel import Nodes
from notebook_accel.interactive import remote
from notebook_accel.interactive.magics import RanksMagic, RanksUsageError, nodes_option
from notebook_accel.interactive.session import Ranks, current, start_ranks
from tests.nodes_helpers import unix_listener

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


# -- the rank's way home ---------------------------------------------------------------------------


def test_connect_rank_directly_on_one_machine(tmp_path) -> None:
    address = str(tmp_path / "k.sock")
    with unix_listener(address) as listener:
        sock = remote.connect_rank(address)
        conn = listener.accept()[0]
        sock.sendall(b"frame")
        assert conn.recv(16) == b"frame"
        sock.close()
        conn.close()


def test_connect_rank_through_its_nodes_relay(tmp_path, monkeypatch) -> None:
    relay = pytest.importorskip("notebook_accel.nodes.relay", reason="needs nodes-core's relay")
    agent_side = str(tmp_path / "relay.sock")
    # What a node's agent puts in the environment of the ranks it starts after relay_unix().
    monkeypatch.setenv(relay.RELAY_ENV_PREFIX + "tok123", agent_side)
    with unix_listener(agent_side) as listener:
        sock = remote.connect_rank("/kernel/side/ranks.sock", "tok123")
        conn = listener.accept()[0]
        sock.sendall(b"frame")
        assert conn.recv(16) == b"frame"  # the same bytes as on one machine: no header
        sock.close()
        conn.close()
    with pytest.raises(KeyError, match=r"no relay 'other'"):
        remote.connect_rank("/kernel/side/ranks.sock", "other")


def test_connect_rank_to_a_missing_socket_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        remote.connect_rank(str(tmp_path / "gone.sock"))


def test_relay_hook_opens_the_relay_and_gives_the_ranks_its_token() -> None:
    from notebook_accel.interactive.links import RelayedLinks
    from notebook_accel.interactive.rank_entry import rank_main
    from notebook_accel.launch.request import LaunchRequest

    ends: list = []

    class _Relay:
        def open(self, stream_ends) -> str:
            ends.append(stream_ends)
            return "tok9"

    request = LaunchRequest(function=rank_main, args=("/tmp/k.sock", 7, (1,)), num_processes=1)
    opened: list = []
    started = remote.relay_hook(request, opened)(SimpleNamespace(relay=_Relay()))
    # The group's links are the relay's stream ends, and reach the caller.
    assert len(opened) == 1 and isinstance(opened[0], RelayedLinks) and ends == opened
    # No kernel socket, no listener fd on another machine; the GPUs kept; the relay's token as `relay`.
    assert started.args == ("", None, (1,), "tok9") and started.function is rank_main
    assert request.args == ("/tmp/k.sock", 7, (1,))  # the request given is left as it was


def test_status_table_names_each_ranks_node_across_nodes() -> None:
    from notebook_accel.interactive.display import StatusTable
    from notebook_accel.interactive.session import RankState

    table = StatusTable(
        [RankState(0, 11, "idle", node="n1"), RankState(1, 12, "running", "x = 1", node="n2")]
    )
    assert repr(table).splitlines()[0].split() == [
        "node",
        "rank",
        "pid",
        "state",
        "cell",
        "cpu",
        "%",
        "memory",
    ]
    assert table.cells()[1][:4] == ("n2", "1", "12", "running")
    assert "<th>node</th>" in table._repr_html_()
    one_machine = StatusTable([RankState(0, 11, "idle")])
    assert one_machine.columns == StatusTable.columns and one_machine.cells()[0][0] == "0"


# -- ranks on two "nodes": agents started here by the test placement (real agents, channel and relay) --


def test_ranks_across_two_nodes_through_their_agents(monkeypatch, capsys) -> None:
    from notebook_accel.interactive import startup
    from tests.nodes_helpers import LocalPlacement

    groups: list = []  # the joined NodeGroup of each start, to count the relayed streams
    real_hook = startup.relay_hook

    def recording_hook(request, opened):
        hook = real_hook(request, opened)
        return lambda group: groups.append(group) or hook(group)

    monkeypatch.setattr(startup, "relay_hook", recording_hook)
    placement = LocalPlacement(("n1", "n2"))
    kernel_only = "only in the kernel"  # noqa: F841 - the ranks must not see it
    ranks = start_ranks(2, nodes=placement, hang_timeout=3)
    try:
        assert repr(ranks) == "<Ranks 4 rank(s), alive>"
        # Every rank reached the kernel through its node's relay socket (these "nodes" could reach it directly).
        assert len(groups) == 1 and groups[0].relay.open_streams() == 4
        assert [(s.rank, s.node, s.state) for s in ranks.status()] == [
            (0, "n1", "idle"),
            (1, "n1", "idle"),
            (2, "n2", "idle"),
            (3, "n2", "idle"),
        ]
        # Spawned: the namespaces hold rank, world_size and device, nothing of the kernel.
        names = ranks.run("sorted(k for k in globals() if not k.startswith('_'))")
        assert names == [["device", "rank", "world_size"]] * 4
        with pytest.raises(Exception, match=r"NameError.*kernel_only"):
            ranks.execute("kernel_only")
        ranks.push("factor", 10)
        code = "import torch, torch.distributed as dist\nt = torch.ones(1) * rank * factor\ndist.all_reduce(t)\nt.item()"
        assert ranks.run(code) == [60.0] * 4
        assert ranks.run("rank", on=[0, 3]) == [0, 3]
        ranks.execute("print('hello from', rank)")
        printed = capsys.readouterr().out
        assert "[n1 rank 1] hello from 1" in printed and "[n2 rank 3] hello from 3" in printed, printed
        # Honest work past hang_timeout: one report, naming the machine of every rank it mentions.
        code = (
            "import time\nfrom notebook_accel import PartialState\nwith PartialState().main_process_first():\n"
            "    if rank == 0:\n        time.sleep(8)\nrank"
        )
        assert ranks.run(code) == [0, 1, 2, 3]
        printed = capsys.readouterr().out
        assert printed.count("a busy rank is not a hang") == 1, printed
        assert "rank 1 (n1) in barrier, rank 2 (n2) in barrier, rank 3 (n2) in barrier (for " in printed, (
            printed
        )
        assert "while rank(s) 0 (n1) are busy" in printed and "  rank 3 (n2): in barrier" in printed
        assert re.search(r"Stacks of rank 0 \(pid \d+, on n1\):", printed), printed
        assert ranks.run(divmod, 7, 2) == [(3, 1)] * 4  # a function travels by value
        assert [t.item() for t in ranks.pull("t")] == [60.0] * 4
        with pytest.raises(Exception, match=r"raised on rank\(s\) \[2\]; the ranks are alive"):
            ranks.execute("if rank == 2:\n    raise ValueError('on n2 only')")
        assert ranks.alive and ranks.run("factor") == [10] * 4
        assert ranks.restart() == [0, 1, 2, 3]
        with pytest.raises(Exception, match=r"NameError"):
            ranks.execute("factor")  # fresh namespaces on every node
        assert [s.node for s in ranks.status()] == ["n1", "n1", "n2", "n2"]
    finally:
        ranks.stop()
    deadline = time.monotonic() + 30
    while any(p.poll() is None for p in placement.popens) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p.poll() is not None for p in placement.popens] == [True] * 4  # both agents, twice: all ended
