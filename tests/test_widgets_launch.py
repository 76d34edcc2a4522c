"""LaunchPanel on real non-blocking launches of 2 CPU workers: status, output tabs, filter, error, Stop."""

from __future__ import annotations

import re

import pytest
from notebook_accel.widgets import LaunchPanel

from notebook_accel import notebook_launcher
from tests.launcher_helpers import wait_until
from tests.panel_helpers import FakeRun, rank_status


def _talk(steps: int, fail_rank: int | None) -> int:
    import os

    # The rank from the torchrun environment: no process group needed for what the panel shows.
    rank = int(os.environ["RANK"])
    for i in range(steps):
        print(f"step {i} loss {1.0 / (i + 1):.3f}", flush=True)
    if rank == fail_rank:
        raise ValueError(f"bad batch on rank {fail_rank}")
    return rank


def _forever() -> None:
    import time as _time

    print("started", flush=True)
    while True:
        _time.sleep(0.05)


def _panel(function, args: tuple = (), interval: float = 0.05) -> tuple:
    """Return ``(handle, panel)``: a non-blocking launch of ``function`` on 2 workers and its panel, view built."""
    handle = notebook_launcher(function, args, num_processes=2, block=False, sinks=[])
    panel = LaunchPanel(handle, interval=interval)
    assert panel.widget is not None
    return handle, panel


def _forever_panel(interval: float = 0.05) -> tuple:
    """Return ``(handle, panel)`` of 2 workers that run until stopped, once both printed their first line."""
    handle, panel = _panel(_forever, interval=interval)
    wait_until(lambda: len(panel.merged_lines()) == 2)
    return handle, panel


def test_successful_launch():
    handle, panel = _panel(_talk, (3, None))
    view = panel.widget
    assert handle.result(timeout=30) == [0, 1]
    wait_until(lambda: panel.state == "succeeded" and panel._w_state.description == "succeeded")
    assert panel._w_state.button_style == "success" and panel._w_stop.disabled
    assert panel.lines(0) == ["step 0 loss 1.000", "step 1 loss 0.500", "step 2 loss 0.333"]
    assert sorted(panel.merged_lines()) == sorted(f"[rank {r}] {t}" for r in (0, 1) for t in panel.lines(r))
    rows = panel.rows()
    assert [r["rank"] for r in rows] == [0, 1] and all(r["state"] == "succeeded" for r in rows)
    assert rows[0]["pid"] == handle.pids[0] and rows[0]["last_line"] == "step 2 loss 0.333"
    assert panel._w_tabs.titles == ("all ranks", "rank 0", "rank 1")
    assert "step 2 loss 0.333" in panel._w_rank_out[1].value
    panel._w_filter.value = "0.333"
    assert sorted(panel.merged_lines()) == ["[rank 0] step 2 loss 0.333", "[rank 1] step 2 loss 0.333"]
    assert "step 1" not in panel._w_merged.value
    assert panel._w_error.value == "" and panel.error_text() == ""
    assert "succeeded" in repr(panel) and "<table>" in panel._repr_html_()
    assert view is panel.widget
    panel.close()


def test_failed_launch_shows_the_root_cause():
    handle, panel = _panel(_talk, (2, 1))
    handle.wait(30)
    wait_until(lambda: panel._w_state.description == "failed")
    assert panel.state == "failed" and panel._w_state.button_style == "danger"
    text = panel.error_text()
    assert (
        text.startswith("rank 1 (pid") and "ValueError: bad batch on rank 1" in text and "Traceback" in text
    )
    assert "Launch failed" in panel._w_error.value and "bad batch on rank 1" in panel._w_error.value
    assert "bad batch" in panel._repr_html_()
    panel.close()


def test_stop_button_stops_every_worker():
    handle, panel = _forever_panel()
    running = panel.rows()
    assert all(r["state"] == "running" for r in running)
    wait_until(lambda: all(r["rss"] for r in panel.rows()))
    assert all(r["cpu_percent"] is not None for r in panel.rows())
    assert panel._w_state.description == "running" and not panel._w_stop.disabled
    panel._w_stop.click()
    assert handle.wait(20)
    wait_until(lambda: panel._w_state.description == "stopped")
    assert panel.state == "stopped" and panel._w_stop.disabled
    panel.stop()  # idempotent
    panel.close()


def test_panel_of_a_finished_launch_and_of_a_running_one():
    handle = notebook_launcher(_talk, (2, None), num_processes=2, block=False, sinks=[])
    running = LaunchPanel(handle, interval=0.05)  # built while the workers run
    assert handle.wait(30)
    # Built after the end: add_done_callback and subscribe call back at once, inside __init__.
    finished = LaunchPanel(handle, interval=0.05)
    assert finished.state == "succeeded"
    assert finished.lines(1) == ["step 0 loss 1.000", "step 1 loss 0.500"]
    finished._ticker.join(5)
    assert not finished._ticker.is_alive()
    assert finished.widget is not None
    assert finished._w_stop.disabled and finished._w_state.description == "succeeded"
    wait_until(lambda: running.lines(1) == finished.lines(1))
    assert running.widget is not None
    wait_until(lambda: running._w_stop.disabled)
    assert running._w_state.description == "succeeded"
    running.close()
    finished.close()


def test_stop_button_is_disabled_as_soon_as_the_launch_ends():
    # A one-hour throttle: only the done callback itself can update the controls in this test.
    handle, panel = _forever_panel(interval=3600)
    panel._throttle.flush()
    assert not panel._w_stop.disabled and panel._w_stop.button_style == "danger"
    panel.stop()
    assert handle.wait(20)
    wait_until(lambda: panel._w_stop.disabled, timeout=5)
    assert panel._w_state.description == "stopped" and panel._w_state.button_style == "warning"
    assert panel._w_stop.button_style == "" and panel._w_stop.tooltip == "launch stopped"
    panel.close()


def test_closed_panel_still_greys_out_its_stop_button():
    handle, panel = _forever_panel()
    panel.close()  # no more view updates...
    handle.stop()
    assert handle.wait(20)
    wait_until(lambda: panel._w_stop.disabled, timeout=5)  # ...but the end still shows
    assert panel._w_state.description == "stopped"


def test_notebook_launcher_panel_true(capsys):
    handle = notebook_launcher(_talk, (1, None), num_processes=2, block=False, panel=True, sinks=[])
    assert handle.result(timeout=30) == [0, 1]
    # Outside a kernel the panel shows as its text summary: proof that panel=True made one.
    assert "LaunchPanel(" in capsys.readouterr().out


def test_bad_arguments_raise():
    with pytest.raises(
        TypeError, match="LaunchPanel needs a LaunchHandle.*got object, not a .*RunView"
    ):
        LaunchPanel(object())
    handle = notebook_launcher(_talk, (1, None), num_processes=2, block=False, sinks=[])
    panel = LaunchPanel(handle)
    handle.wait(30)
    with pytest.raises(ValueError, match=r"Unknown rank 5: this launch has ranks \[0, 1\]"):
        panel.lines(5)
    panel.close()


def _bar_loop(steps: int) -> int:
    import time as _time

    from tqdm.auto import tqdm

    for i in tqdm(range(steps), desc="epoch", mininterval=0.01):
        if i % 250 == 0:
            print(f"at {i}", flush=True)
        _time.sleep(0.002)
    return steps


def test_panel_shows_live_bars_of_the_main_process_and_usage_numbers():
    handle = notebook_launcher(
        _bar_loop, (1000,), num_processes=2, block=False, sinks=[], progress_bars="main"
    )
    panel = LaunchPanel(handle, interval=0.05)
    panel.widget  # noqa: B018 - build the view
    seen_running = []

    def running_bar() -> bool:
        boxes = panel._w_bars.box.children
        if boxes and not handle.done:
            progress, label = boxes[0].children
            seen_running.append((progress.value, progress.max, label.value))
        return handle.done

    wait_until(running_bar, timeout=60)
    assert handle.result() == [1000, 1000]
    assert any(0 < value < 1000 and top == 1000.0 for value, top, _ in seen_running), seen_running
    wait_until(lambda: panel._w_state.description == "succeeded")
    (box,) = panel._w_bars.box.children  # the main process's bar only: one row
    progress, label = box.children
    assert (progress.value, progress.max, progress.bar_style) == (1000.0, 1000.0, "success")
    assert "[rank 0] epoch: 100%" in label.value and "1000/1000" in label.value
    # Beside the graphical bar, tqdm's line less its text bar: counts, elapsed<remaining, rate.
    live = next(text for value, _, text in seen_running if 0 < value < 1000)
    assert re.search(r"\[rank 0\] epoch: +\d+% \d+/1000 \[\d\d:\d\d&lt;\d\d:\d\d, +[\d.]+it/s\]", live), live
    assert not any("|" in text or "\u2588" in text for _, _, text in seen_running), seen_running
    assert "|" not in label.value and "\u2588" not in label.value, label.value
    assert [b.rank for b in panel.bars()] == [0]
    # The rank tab: the prints and one final bar line, not a line per redraw.
    assert panel.lines(1) == ["at 0", "at 250", "at 500", "at 750", panel.lines(1)[-1]]
    assert "1000/1000" in panel.lines(1)[-1]
    # CPU % and memory columns hold numbers (the run's average and last figures once it ended).
    for row in panel.rows():
        assert row["cpu_percent"] is not None and row["rss"] > 0 and row["peak_rss"] >= row["rss"]
    status = panel._w_status.value
    assert status.count("MiB") >= 4 and "peak memory" in status and "CUDA" not in status
    assert "[rank 0] epoch: 100%" in repr(panel)
    panel.close()


def test_cuda_column_shows_when_a_rank_reports_cuda_memory():
    # CUDA figures a CPU-only machine cannot produce.
    run = FakeRun([rank_status(0, cuda_allocated=1 << 30, cuda_reserved=2 << 30), rank_status(1)])
    panel = LaunchPanel(run, interval=0.05)
    text = repr(panel)
    assert "CUDA allocated / reserved" in text and "1.00 GiB / 2.00 GiB" in text
    assert "- / -" in text  # rank 1 never initialised CUDA
    assert panel.bars() == [] and panel.chart_data() == {}  # a handle without events: no bars, no chart
    panel.close()


def test_stacks_button_shows_every_rank_side_by_side():
    handle = notebook_launcher(_forever, num_processes=2, block=False, sinks=[])
    panel = LaunchPanel(handle, interval=0.05)
    assert panel.widget is not None
    wait_until(lambda: len(panel.merged_lines()) == 2)
    # both workers installed their stacks handler
    wait_until(lambda: all(s.answered for s in handle.stacks().values()))
    # handle.stacks(): each frame is followed by its source line, as in a traceback.
    for stack in handle.stacks().values():
        lines = stack.text.splitlines()
        at = next(i for i, line in enumerate(lines) if line.endswith(" in _forever"))
        assert lines[at + 1] == "    _time.sleep(0.05)", stack.text
        assert "_time.sleep(0.05)" not in stack.dump  # faulthandler's own dump has no source
    panel._w_stacks_button.click()
    assert sorted(panel.stacks) == [0, 1]
    assert all("in _forever at test_widgets_launch.py" in s.summary() for s in panel.stacks.values())
    view = panel._w_stacks.value
    assert view.count("<td") == 2 and "rank 0" in view and "rank 1" in view and "_forever" in view
    # The panel's stacks show the source lines too: the loop's line once per rank.
    assert view.count("    _time.sleep(0.05)") == 2, view
    assert handle.status()[0].state == "running"  # taking the stacks stopped nothing
    panel.stop()
    assert handle.wait(20)
    wait_until(lambda: panel._w_stacks_button.disabled)
    panel.close()


def test_metric_chart_of_a_single_step_has_whole_step_ticks(monkeypatch):
    from notebook_accel.widgets import _metrics_chart

    figures = []
    monkeypatch.setattr(_metrics_chart, "_to_png", lambda fig, **_margins: figures.append(fig) or b"png")
    assert _metrics_chart.metrics_png({"loss": ([3], [1.0]), "lr": ([0, 1, 2], [0.1, 0.1, 0.1])}) == b"png"
    one, three = figures[0].axes
    assert one.get_xlim() == (2.0, 4.0)  # not 2.955..3.045 with ticks at fractions of a step
    assert [t for t in one.get_xticks() if 2 <= t <= 4] == [2.0, 3.0, 4.0]
    assert three.get_xlim()[0] < 0 < 2 < three.get_xlim()[1]
