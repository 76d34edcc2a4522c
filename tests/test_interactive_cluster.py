"""Interactive ranks across two nodes of the namespace cluster, from a real ipykernel with the %ranks magics;
and notebooks/several_machines.ipynb executed there (nbval skips it: it needs machines to reach).

Every test here takes ``ns_cluster`` (tests/ns_cluster.py): where the machine cannot build it (not root,
no ``ip netns``, no sshd/Slurm), they skip, saying why.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.launcher_helpers import printed_by
from tests.test_launcher_kernel import Kernel, interactive_kernel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kernel(ns_cluster):
    yield from interactive_kernel(
        f"""
        import time
        from notebook_accel import Nodes, interactive
        %load_ext notebook_accel
        cluster = Nodes(hosts={list(ns_cluster.nodes)!r}, ssh_options={list(ns_cluster.ssh_options)!r})
        kernel_only = "from the kernel"
        """,
        timeout=60,
    )


def _ensure(kernel: Kernel) -> None:
    kernel.ok(
        "ranks = interactive.current()\nif ranks is None or not ranks.alive:\n    %ranks stop\n    %ranks start 2 --nodes cluster",
        240,
    )


def _workload(ns_cluster) -> dict[str, list[int]]:
    return {node: ns_cluster.workload_pids(node) for node in ns_cluster.nodes}


def _assert_nothing_left(ns_cluster, timeout: float = 30) -> None:
    """Every agent and rank on every node ended (within ``timeout``: an agent ends its ranks, then itself)."""
    deadline = time.monotonic() + timeout
    while any(_workload(ns_cluster).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _workload(ns_cluster) == {node: [] for node in ns_cluster.nodes}


def test_ranks_on_two_nodes_start_empty_and_reduce_across_them(kernel, ns_cluster) -> None:
    _ensure(kernel)
    out = kernel.ok("print([(s.rank, s.node) for s in interactive.current().handle.status()])")
    assert "[(0, 'n1'), (1, 'n1'), (2, 'n2'), (3, 'n2')]" in out
    # Spawned on the nodes: nothing of the kernel's namespace is there, only rank, world_size and device.
    status, out, err, ename = kernel.run("%%ranks\nkernel_only")
    assert status == "error" and "NameError" in err and "raised on rank(s) [0, 1, 2, 3]" in err, err
    kernel.ok("%ranks push kernel_only")
    # What the ranks print streams into the cell, labelled with the node and rank.
    out = kernel.ok(
        "%%ranks\nimport torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
        "print('reduced', t.item(), world_size, kernel_only)",
    )
    # A line every rank prints alike shows once ([n1,n2 ranks 0-3]) or per rank ([n2 rank 3]), by node.
    text = "reduced 10.0 4 from the kernel"
    assert sorted(printed_by(out, text)) == [0, 1, 2, 3], out
    labels = [line[: -len(text)] for line in out.splitlines() if line.endswith(f"] {text}")]
    assert labels and all(re.fullmatch(r"\[n[12](,n2)? ranks? [\d,-]+\] ", label) for label in labels), out
    out = kernel.ok("%%ranks 0,3\nprint('hundreds', rank * 100)")
    assert re.search(r"rank 0\] hundreds 0", out) and re.search(r"rank 3\] hundreds 300", out), out
    assert "rank 1]" not in out and "rank 2]" not in out
    out = kernel.ok("%ranks pull t\nprint([x.item() for x in t])")
    assert "[10.0, 10.0, 10.0, 10.0]" in out
    out = kernel.ok("table = %ranks status\nprint(repr(table))")
    assert re.search(r"^node\s+rank\s+pid", out, re.M) and re.search(r"^n2\s+3\s+\d+\s+idle", out, re.M), out


def test_stop_button_interrupts_ranks_on_every_node(kernel, ns_cluster) -> None:
    _ensure(kernel)
    kernel.ok("%%ranks\nkept = rank * 2")
    seconds, _, _ = kernel.interrupted(
        "%%ranks\nimport time\nprint('sleeping', flush=True)\ntime.sleep(120)", after="sleeping", timeout=120
    )
    assert seconds < 60
    out = kernel.ok("%ranks pull kept\nprint(kept, interactive.current().alive)")
    assert "[0, 2, 4, 6] True" in out  # namespaces kept after Stop, as on one machine


def test_restart_and_stop_leave_nothing_on_the_nodes(kernel, ns_cluster) -> None:
    _ensure(kernel)
    kernel.ok("%%ranks\nkept = rank")
    kernel.ok("%ranks restart", 240)
    status, _, err, _ = kernel.run("%%ranks\nkept")
    assert status == "error" and "NameError" in err  # fresh namespaces on every node
    kernel.ok("%ranks stop")
    _assert_nothing_left(ns_cluster)


def test_several_machines_notebook_runs_on_the_cluster(ns_cluster, monkeypatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("SEVERAL_MACHINES_HOSTS", ",".join(ns_cluster.nodes))
    monkeypatch.setenv("SEVERAL_MACHINES_SSH_OPTIONS", " ".join(ns_cluster.ssh_options))
    path = ROOT / "notebooks" / "several_machines.ipynb"
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        shutdown_kernel="immediate",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # a cell that raises fails the test with its traceback

    def text(cell) -> str:
        return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs)

    checked = [text(c) for c in nb.cells if c.cell_type == "code" and "NBVAL_CHECK_OUTPUT" in c.source]
    assert checked[0].splitlines() == [
        "[(0, 0, 4, 10.0), (1, 1, 4, 10.0), (2, 0, 4, 10.0), (3, 1, 4, 10.0)]",
        "{0: 'n1', 1: 'n1', 2: 'n2', 3: 'n2'}",
    ]
    assert "[all 4 ranks] 60.0" in checked[1]
    assert "[60.0, 60.0, 60.0, 60.0]" in checked[2]
    _assert_nothing_left(ns_cluster)
