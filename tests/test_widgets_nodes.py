"""LaunchPanel grouped by node: the model driven with the statuses of a launch across two machines.

A launch with ``nodes=`` gives each ``RankStatus`` its host (``node``); the panel then shows a row per
node (state, summed CPU %, memory, CUDA memory) above that node's ranks, and names the node in output
lines, bars and tabs. The run here is ``tests/panel_helpers.FakeRun``, carrying real ``RankStatus``/
``OutputLine``/``BarState`` values (the end-to-end run across real nodes is in the cluster tests, and a
launch on two agents here below); a real launch on one machine shows no groups.
"""

from __future__ import annotations

import pytest
from notebook_accel.widgets import LaunchPanel
from notebook_accel.widgets import _launch_render as render

from notebook_accel import notebook_launcher
from notebook_accel.launch.doctor import Frame, RankStack, ThreadStack
from notebook_accel.launch.events import BarState
from tests.panel_helpers import FakeRun, rank_status

pytest.importorskip("ipywidgets")

MiB = 1024**2


def _status(
    rank: int, node: str | None, state: str = "running", cpu: float = 50.0, rss: int = 100 * MiB, **kw
):
    return rank_status(rank, node, state, cpu_percent=cpu, rss=rss, peak_rss=rss + MiB, **kw)


def _bar(rank: int, n: float) -> BarState:
    return BarState(
        rank=rank,
        id=0,
        desc="train",
        n=n,
        total=10,
        elapsed=1.0,
        rate=1.0,
        unit="it",
        text=f"train: {n * 10:.0f}%|##   | {n:.0f}/10 [00:01<00:09, 1.00it/s]",
        closed=False,
        leave=True,
        stream="stderr",
    )


def _two_nodes(**extra) -> FakeRun:
    statuses = [
        _status(0, "gpu-a", cpu=90.0, rss=200 * MiB, **extra),
        _status(1, "gpu-a", cpu=10.0, rss=100 * MiB, **extra),
        _status(2, "gpu-b", state="failed", cpu=0.0, rss=50 * MiB, **extra),
        _status(3, "gpu-b", cpu=40.0, rss=150 * MiB, **extra),
    ]
    return FakeRun(statuses, bars=[_bar(0, 3), _bar(2, 1)])


def test_ranks_are_grouped_by_node_with_summed_figures():
    handle = _two_nodes()
    panel = LaunchPanel(handle, interval=0.05)
    try:
        groups = panel.node_groups()
        assert [(g["node"], g["ranks"]) for g in groups] == [("gpu-a", [0, 1]), ("gpu-b", [2, 3])]
        # A failed rank is what its node shows, though the node's other rank still runs.
        assert [g["state"] for g in groups] == ["running", "failed"]
        assert groups[0]["cpu_percent"] == pytest.approx(100.0) and groups[1]["cpu_percent"] == pytest.approx(
            40.0
        )
        assert groups[0]["rss"] == 300 * MiB and groups[1]["peak_rss"] == 202 * MiB
        assert groups[0]["cuda_allocated"] is None  # no rank on a CPU node reports CUDA memory
        assert [r["node"] for r in panel.rows()] == ["gpu-a", "gpu-a", "gpu-b", "gpu-b"]

        text = repr(panel)
        lines = text.splitlines()
        a, b = (
            next(i for i, line in enumerate(lines) if line.startswith(f"[{n}]")) for n in ("gpu-a", "gpu-b")
        )
        assert "ranks 0,1" in lines[a] and "running" in lines[a] and "300.00 MiB" in lines[a]
        assert "ranks 2,3" in lines[b] and "failed" in lines[b]
        assert lines[a + 1].lstrip().startswith("0") and lines[b + 2].lstrip().startswith("3")
        assert "[gpu-a rank 0] train" in text and "[gpu-b rank 2] train" in text

        status_html = panel._status_html()
        assert status_html.count("class='node-group'") == 2
        assert status_html.index("gpu-a") < status_html.index(">2<") < status_html.index(">3<")
        assert "[gpu-b rank 2]" in panel._bars_html()
    finally:
        panel.close()


def test_lines_tabs_and_stop_name_the_node():
    handle = _two_nodes()
    panel = LaunchPanel(handle, interval=0.05)
    try:
        view = panel.widget
        handle.emit(3, "loss 0.5")
        handle.emit(0, "warn", stream="stderr")
        assert panel.merged_lines() == ["[gpu-b rank 3] loss 0.5", "[gpu-a rank 0!] warn"]
        assert panel.lines(3) == ["loss 0.5"]
        assert panel._w_tabs.titles == (
            "all ranks",
            "gpu-a rank 0",
            "gpu-a rank 1",
            "gpu-b rank 2",
            "gpu-b rank 3",
        )
        assert view is panel.widget
        panel.refresh()
        assert "node-group" in panel._w_status.value
        panel.stop()
        assert handle.stopped == 1
        handle.finish("stopped")
        assert panel.state == "stopped"
        assert [g["state"] for g in panel.node_groups()] == ["stopped", "stopped"]
    finally:
        panel.close()


def test_the_stacks_view_and_the_hang_report_name_each_ranks_node():
    handle = _two_nodes()
    thread = ThreadStack("0x1", True, (Frame("/u/train.py", 3, "step"),))
    handle.stacks = lambda: {
        s.rank: RankStack(s.rank, s.pid, (thread,), "d", node=s.node) for s in handle.statuses
    }
    handle.hang_report = "rank 1 (gpu-a) in barrier (for 61 s) while rank(s) 3 (gpu-b) are busy; ..."
    panel = LaunchPanel(handle, interval=0.05)
    try:
        assert sorted(panel.show_stacks()) == [0, 1, 2, 3]
        snap = panel.snapshot()
        html = render.stacks_html(snap)
        assert "<b>rank 0 (gpu-a)</b>: in step at train.py:3" in html and "<b>rank 3 (gpu-b)</b>" in html
        hang = render.hang_html(snap)
        assert "<b>Hang report</b>" in hang and "rank(s) 3 (gpu-b) are busy" in hang
    finally:
        panel.close()


def test_cuda_memory_is_summed_per_node():
    handle = _two_nodes(cuda_allocated=2 * MiB, cuda_reserved=4 * MiB)
    panel = LaunchPanel(handle, interval=0.05)
    try:
        groups = panel.node_groups()
        assert groups[0]["cuda_allocated"] == 4 * MiB and groups[1]["cuda_reserved"] == 8 * MiB
        header = next(line for line in repr(panel).splitlines() if line.startswith("[gpu-a]"))
        assert "4.00 MiB / 8.00 MiB" in header
    finally:
        panel.close()


def test_one_machine_launch_shows_no_groups():
    handle = notebook_launcher(print, ("hello",), num_processes=2, block=False, sinks=[])
    panel = LaunchPanel(handle, interval=0.05)
    try:
        handle.wait(60)
        assert panel.node_groups() == []
        assert all(r["node"] is None for r in panel.rows())
        assert "node-group" not in panel._status_html()
        assert sorted(panel.merged_lines()) == ["[rank 0] hello", "[rank 1] hello"]
    finally:
        panel.close()


def test_a_real_launch_across_two_nodes_is_grouped():
    """notebook_launcher(nodes=...) with two 'nodes' of the test placement (real agents on this machine)."""
    from tests.nodes_helpers import LocalPlacement

    placement = LocalPlacement(("n1", "n2"))
    handle = notebook_launcher(print, ("hello",), num_processes=2, nodes=placement, block=False)
    panel = LaunchPanel(handle, interval=0.05)
    try:
        handle.wait(180)
        groups = panel.node_groups()
        assert [(g["node"], g["ranks"], g["state"]) for g in groups] == [
            ("n1", [0, 1], "succeeded"),
            ("n2", [2, 3], "succeeded"),
        ]
        assert all(g["peak_rss"] and g["peak_rss"] > 0 for g in groups)  # usage relayed by the agents
        assert sorted(panel.merged_lines()) == [
            f"[{n} rank {r}] hello" for n, r in (("n1", 0), ("n1", 1), ("n2", 2), ("n2", 3))
        ]
        assert repr(panel).count("\n[n") == 2
    finally:
        panel.close()
        for proc in placement.popens:  # the agents end after the launch: none is left to the next test
            proc.wait(30)
