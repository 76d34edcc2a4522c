"""The launch panel's model without any widget: built over a real finished launch with ipywidgets blocked,
and driven through the run's read-only view with lines, events, restarts, hangs and an end it cannot produce
on its own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
from notebook_accel.widgets._launch_model import LaunchModel
from notebook_accel.widgets._launch_render import panel_text

from notebook_accel.launch.errors import LaunchError, RankFailure
from notebook_accel.launch.events import BarState
from notebook_accel.launch.restarts import Attempt
from tests.panel_helpers import FakeRun, rank_status

# Blocks the GUI libraries (an import of any raises ImportError), then builds the model over a real launch
# of two ranks that print to stdout and stderr, and prints what the model says as JSON.
_NO_WIDGETS = textwrap.dedent(
    """
    import json, sys
    for name in ("ipywidgets", "matplotlib", "IPython"):
        sys.modules[name] = None

    from notebook_accel import notebook_launcher
    from notebook_accel.widgets._launch_model import LaunchModel
    from notebook_accel.widgets._launch_render import panel_text


    def talk():
        import os
        rank = int(os.environ["RANK"])
        print(f"loss {rank}.5", flush=True)
        print(f"warn {rank}", file=sys.stderr, flush=True)
        return rank


    handle = notebook_launcher(talk, num_processes=2, block=False, sinks=[])
    assert handle.result(timeout=120) == [0, 1]
    model = LaunchModel(handle)
    snap = model.snapshot()
    model.filter_text = "LOSS"
    out = {
        "state": model.state,
        "snapshot": [snap.title, snap.processes, snap.state, snap.done, snap.interactive],
        "rows": [[r["rank"], r["state"], r["pid"] == pid] for r, pid in zip(snap.rows, handle.pids)],
        "texts": [snap.attempt, snap.restarts, snap.dropped, snap.job, snap.error, snap.hang],
        "groups": snap.groups,
        "lines": [model.lines(0), model.lines(1)],
        "filtered": sorted(model.merged_lines()),
        "received": [model.received(0), model.received(1)],
        "run_view": [handle.max_restarts, handle.restarting, handle.attempts, handle.attempt],
        "text": panel_text(snap),
        "gui": [n for n in ("ipywidgets", "matplotlib", "IPython") if sys.modules[n] is not None],
    }
    model.close()
    print(json.dumps(out))
    """
)


def test_model_over_a_real_launch_with_ipywidgets_blocked() -> None:
    run = subprocess.run([sys.executable, "-c", _NO_WIDGETS], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["state"] == "succeeded" and got["gui"] == []
    assert got["snapshot"] == ["LaunchPanel", 2, "succeeded", True, False]
    assert got["rows"] == [[0, "succeeded", True], [1, "succeeded", True]]
    assert got["texts"] == ["", [], "", "", "", ""] and got["groups"] == []
    assert got["lines"] == [["loss 0.5", "warn 0"], ["loss 1.5", "warn 1"]]
    assert got["filtered"] == ["[rank 0] loss 0.5", "[rank 1] loss 1.5"]
    assert got["received"] == [2, 2]
    # The run-view facts a launch without restarts answers with their defaults.
    assert got["run_view"] == [0, False, [], 1]
    assert got["text"].startswith("LaunchPanel(succeeded)\n") and "succeeded" in got["text"].splitlines()[3]


def _run(nodes: tuple = (None, None)) -> FakeRun:
    return FakeRun([rank_status(r, n) for r, n in enumerate(nodes)])


class _Counting(LaunchModel):
    """The model with its two hooks counted, as the view's redraws would be."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.changes: list[bool] = []
        self.ends = 0
        super().__init__(*args, **kwargs)

    def _changed(self, now: bool = False) -> None:
        self.changes.append(now)

    def _ended(self) -> None:
        self.ends += 1


def _bar(rank: int, number: int, closed: bool, leave: bool = True) -> BarState:
    return BarState(
        rank, number, "epoch", 1.0, 2.0, 1.0, 1.0, "it", f"bar {rank}.{number}", "stderr", closed, leave
    )


def test_lines_are_kept_per_rank_and_merged_bounded_prefixed_and_filtered() -> None:
    run = _run(nodes=(None, "gpu-b"))
    model = _Counting(run, max_lines=3)
    for i in range(5):
        run.emit(0, f"step {i}")
    run.emit(1, "careful", stream="stderr", attempt=2)
    assert model.lines(0) == ["step 2", "step 3", "step 4"] and model.lines(0, limit=1) == ["step 4"]
    assert model.received(0) == 5 and model.received(1) == 1
    # The merged store is bounded too: the three newest lines of all ranks, in arrival order.
    assert model.merged_lines() == [
        "[rank 0] step 3",
        "[rank 0] step 4",
        "[gpu-b rank 1!, attempt 2] careful",
    ]
    assert model.merged_lines(limit=1) == ["[gpu-b rank 1!, attempt 2] careful"]
    model.filter_text = "STEP"
    assert model.merged_lines() == ["[rank 0] step 3", "[rank 0] step 4"]
    assert model.changes == [False] * 6 + [True]  # a line each, then the user's filter at once
    with pytest.raises(ValueError, match=r"Unknown rank 7: this launch has ranks \[0, 1\]"):
        model.lines(7)
    model.close()
    run.emit(0, "after close")
    assert model.received(0) == 5 and not run.line_subscribers and not run.event_subscribers


def test_snapshot_of_a_restarted_run_with_dropped_lines_a_hang_and_bars() -> None:
    run = _run()
    run.max_restarts, run.attempt, run.restarting, run.dropped_lines = 2, 2, True, 7
    run.attempts = [
        Attempt(1, "failed", 0.0, 1.5, rank=1, exitcode=1, failure="rank 1 (pid 9) ValueError: no")
    ]
    run.hang_report = "rank 0 waits in all_reduce"
    run.metrics = [{"step": 0, "loss": 1.0, "note": "x"}, {"step": 1, "loss": 0.5}]
    # Rank 0: four finished bars (the newest three are kept) and an open one; rank 1's closed bar left no trace.
    run.bar_states = [_bar(0, i, closed=True) for i in range(4)] + [
        _bar(0, 4, False),
        _bar(1, 0, True, False),
    ]
    model = _Counting(run)
    for callback in run.event_subscribers:
        callback("bar", 0, None)
    assert model.changes == [False]
    snap = model.snapshot()
    assert (snap.state, snap.done, snap.attempt) == ("running", False, "attempt 2/3, restarting")
    assert snap.restarts == ["attempt 1 failed at " + time.strftime("%H:%M:%S", time.localtime(1.5))
                             + " after 1.5 s: rank 1 (pid 9) ValueError: no (exit code 1)"]  # fmt: skip
    assert snap.dropped == "7 older output line(s) dropped (log_dir=... keeps every line on disk)"
    assert snap.hang == "rank 0 waits in all_reduce" and snap.error == "" and snap.job == ""
    assert [b.text for b in snap.bars] == ["bar 0.1", "bar 0.2", "bar 0.3", "bar 0.4"]
    assert snap.chart == {"loss": ([0, 1], [1.0, 0.5])}
    assert [r["state"] for r in snap.rows] == ["running", "running"] and snap.nodes == {}
    text = panel_text(snap)
    assert text.startswith("LaunchPanel(running, attempt 2/3, restarting)\nattempt 1 failed at ")
    assert "7 older output line(s) dropped" in text and "[rank 0] bar 0.4" in text
    run.live_bar_ranks = {1}  # a view of rank 1's bars only: none open
    assert model.bars() == []
    model.stop()
    assert run.stopped == 1


def test_end_states_and_the_root_cause() -> None:
    run = _run()
    model = _Counting(run)
    failure = RankFailure(1, 101, "ValueError", "bad batch", "Traceback: x", exitcode=1)
    run.finish("succeeded", "failed", error=LaunchError([failure]))
    assert model.ends == 1
    snap = model.snapshot()
    assert (snap.state, snap.done) == ("failed", True)
    assert [r["state"] for r in snap.rows] == ["succeeded", "failed"]
    assert snap.error.startswith("rank 1 (pid 101) ValueError: bad batch\nTraceback: x")
    stopped = _run()
    model = _Counting(stopped)
    stopped.finish("stopped", "stopped", error=LaunchError([], summary="stopped by the user"))
    assert model.state == "stopped"
    fine = _run()
    model = _Counting(fine)
    fine.finish("succeeded", "stopped")  # a rank stopped by the user once the other had succeeded
    assert model.state == "stopped"


def test_an_object_that_is_not_a_run_view_is_refused_by_type() -> None:
    lookalike = type("Lookalike", (), {"status": lambda self: [], "num_processes": 2})()
    with pytest.raises(
        TypeError, match=r"LaunchPanel needs a LaunchHandle.*got Lookalike, not a .*RunView"
    ):
        LaunchModel(lookalike)
