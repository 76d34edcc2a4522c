"""Structured events from launched workers: tqdm bars, NotebookTracker metrics and resource use per rank.

Real launches of 2 CPU workers (fork), plus unit tests of the framing and of the pieces that turn
events into state.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import types

import pytest

from notebook_accel import notebook_launcher
from notebook_accel.launch.cell_bars import kernel_display
from notebook_accel.launch.events import EventHub, FrameDecoder
from notebook_accel.launch.runner import resolve_bars as _resolve_bars
from notebook_accel.launch.usage import apply_usage
from notebook_accel.tracking import NotebookTracker, filter_trackers
from notebook_accel.utils._worker_channel import FRAME_HEADER, send_event

STEPS = 1000


def _tqdm_loop(steps: int, kind: str = "auto") -> int:
    import time as _time

    if kind == "notebook":
        from tqdm.notebook import tqdm
    elif kind == "std":
        from tqdm import tqdm
    else:
        from tqdm.auto import tqdm
    rank = int(os.environ["RANK"])
    for i in tqdm(range(steps), desc=f"train r{rank}", mininterval=0.01):
        if i % 100 == 0:
            # tabs, trailing spaces, a lone \r inside a line and non-ASCII: all must come through as is
            print(f"step {i}\tloss={1 / (i + 1):.4f}  é", flush=True)
        _time.sleep(0.0005)
    return rank


def _expected_prints(steps: int) -> list[str]:
    return [f"step {i}\tloss={1 / (i + 1):.4f}  é" for i in range(0, steps, 100)]


def _launch(fn, args=(), **kwargs):  # noqa: ANN001, ANN202
    handle = notebook_launcher(fn, args, num_processes=2, block=False, sinks=[], **kwargs)
    assert handle.wait(120), "launch did not finish"
    return handle


@pytest.mark.parametrize("kind", ["auto", "std", "notebook"])
def test_1000_tqdm_steps_on_2_ranks_make_one_final_line_per_bar(kind: str) -> None:
    if kind == "notebook":
        pytest.importorskip("ipywidgets")
        import tqdm.notebook  # noqa: F401 - imported in the parent, as a notebook cell would
    handle = _launch(_tqdm_loop, (STEPS, kind), progress_bars="all")
    assert handle.result() == [0, 1]
    for rank in (0, 1):
        lines = handle.lines(rank)
        texts = [line.text for line in lines if line.stream == "stdout"]
        assert texts == _expected_prints(STEPS)  # print output unchanged, nothing added to stdout
        bar_lines = [line.text for line in lines if line.stream == "stderr"]
        assert len(bar_lines) == 1, bar_lines  # the bar's final state, not one line per redraw
        assert f"train r{rank}: 100%" in bar_lines[0] and "1000/1000" in bar_lines[0]
        (bar,) = handle.bars(rank)
        assert (bar.n, bar.total, bar.closed, bar.desc) == (1000, 1000, True, f"train r{rank}")
        assert bar.rate is not None and bar.rate > 0 and bar.elapsed > 0
        assert len(lines) <= len(_expected_prints(STEPS)) + 1


def test_text_mode_leaves_tqdm_writing_its_redraws() -> None:
    handle = _launch(_tqdm_loop, (300,), progress_bars="text")
    assert handle.result() == [0, 1]
    bar_lines = [line.text for line in handle.lines(0) if line.stream == "stderr"]
    assert len(bar_lines) > 2 and "300/300" in bar_lines[-1]  # every redraw is a line, as before
    assert handle.bars() == []
    assert [line.text for line in handle.lines(0) if line.stream == "stdout"] == _expected_prints(300)


_KEPT = []


def _open_and_hidden_bars() -> str:
    from tqdm import tqdm

    for _ in tqdm(range(5), desc="hidden", leave=False):
        pass
    bar = tqdm(total=10, desc="left open")
    bar.update(4)
    bar.refresh()
    _KEPT.append(bar)  # never closed, not even by garbage collection: the launcher keeps its last state
    return "done"


def test_bar_left_open_keeps_its_last_state_and_leave_false_leaves_no_line() -> None:
    handle = _launch(_open_and_hidden_bars, progress_bars="main")
    assert handle.result() == ["done", "done"]
    for rank in (0, 1):
        texts = [line.text for line in handle.lines(rank)]
        assert len(texts) == 1 and "left open" in texts[0] and "4/10" in texts[0], texts
    assert handle.live_bar_ranks == {0}
    assert handle.bars(live_only=True) == []  # everything is closed once the ranks ended


def _log_20_steps() -> int:
    import torch

    from notebook_accel import Accelerator

    accelerator = Accelerator(cpu=True, log_with="notebook")
    accelerator.init_trackers("test", config={"lr": 0.1})
    for step in range(20):
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1)), "lr": 0.1, "note": "x"}, step=step)
    accelerator.end_training()
    return accelerator.process_index


def test_20_logged_steps_reach_handle_metrics_and_the_chart() -> None:
    pytest.importorskip("matplotlib")
    from notebook_accel.widgets import LaunchPanel

    handle = notebook_launcher(_log_20_steps, num_processes=2, block=False, sinks=[])
    panel = LaunchPanel(handle, interval=0.05)
    panel.widget  # noqa: B018 - builds the view, so the chart is drawn too
    assert handle.result(timeout=120) == [0, 1]
    metrics = handle.metrics
    # Only the main process logs: one entry per step, not one per rank.
    assert [m["step"] for m in metrics] == list(range(20))
    assert [m["loss"] for m in metrics] == pytest.approx([1.0 / (s + 1) for s in range(20)])
    assert all(m["lr"] == 0.1 and m["note"] == "x" for m in metrics)
    steps, values = panel.chart_data()["loss"]
    assert steps == list(range(20)) and values == pytest.approx([1.0 / (s + 1) for s in range(20)])
    assert "note" not in panel.chart_data()  # strings are kept in metrics, not charted
    deadline = time.monotonic() + 10
    while panel._w_chart.value[:4] != b"\x89PNG" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert panel._w_chart.value[:4] == b"\x89PNG" and panel._w_chart.layout.display == ""
    handle.metrics.clear()  # a copy: the handle keeps its own
    assert len(handle.metrics) == 20
    panel.close()


def test_metrics_frame_names_pandas_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = _launch(_log_20_steps)
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="metrics_frame\\(\\) needs pandas"):
        handle.metrics_frame()


def _spin_until(path: str) -> float:
    import time as _time

    total = 0.0
    while not os.path.exists(path):
        total += sum(i * i for i in range(20_000))  # busy: CPU % well above zero
        _time.sleep(0.001)
    return total


def test_status_rows_carry_cpu_and_memory_while_running_and_after(tmp_path) -> None:  # noqa: ANN001
    flag = tmp_path / "stop"
    handle = notebook_launcher(_spin_until, (str(flag),), num_processes=2, block=False, sinks=[])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = handle.status()
            if all(r.cpu_percent and r.cpu_percent > 0 for r in rows):
                break
            time.sleep(0.2)
        assert all(r.state == "running" for r in rows)
        assert all(r.cpu_percent > 0 and r.rss > 1 << 20 and r.peak_rss >= r.rss for r in rows), rows
        assert all(r.cuda_allocated is None for r in rows)  # CPU-only run: no CUDA figures
    finally:
        flag.write_text("")
    handle.result(timeout=60)
    for row in handle.status():
        assert row.cpu_percent is not None and row.rss is not None
        assert row.peak_rss is not None and row.peak_rss >= row.rss


def test_progress_bars_option_is_validated() -> None:
    with pytest.raises(
        ValueError, match=r"progress_bars='bars' is not one of \['auto', 'main', 'all', 'text'\]"
    ):
        notebook_launcher(_tqdm_loop, (1,), num_processes=2, progress_bars="bars")
    assert _resolve_bars("auto", panel=False) == (False, None)  # a plain script: tqdm's own text
    assert _resolve_bars("auto", panel=True) == (True, {0})
    assert _resolve_bars("all", panel=False) == (True, None)
    assert _resolve_bars("text", panel=True) == (False, None)


# -- units ----------------------------------------------------------------------------------------


def _frames(*messages: tuple) -> bytes:
    out = b""
    for message in messages:
        body = pickle.dumps(message)
        out += FRAME_HEADER.pack(len(body)) + body
    return out


def test_frame_decoder_at_every_split_point() -> None:
    messages = [("event", "bar", {"n": 1}), ("event", "metrics", {"step": 0, "loss": 1.0}), ("ok", [1, 2])]
    data = _frames(*messages)
    for cut in range(len(data) + 1):
        decoder = FrameDecoder()
        got = decoder.feed(data[:cut]) + decoder.feed(data[cut:])
        assert got == messages and decoder.pending == 0
    decoder = FrameDecoder()
    assert decoder.feed(data[:-3]) == messages[:2] and decoder.pending > 0  # a truncated last frame waits


def test_event_hub_lines_and_live_ranks() -> None:
    hub = EventHub(live_ranks={0})
    seen = []
    unsubscribe = hub.subscribe(lambda kind, rank, state: seen.append((kind, rank)))
    base = {"desc": "d", "n": 1, "total": 2, "elapsed": 0.1, "rate": 10.0, "unit": "it", "stream": "stderr"}
    for rank in (0, 1):
        assert (
            hub.dispatch(rank, "bar", {**base, "id": 0, "text": "half", "closed": False, "leave": True}) == []
        )
    assert [b.rank for b in hub.bars(live_only=True)] == [0]
    lines = hub.dispatch(0, "bar", {**base, "id": 0, "n": 2, "text": "full", "closed": True, "leave": True})
    assert [(line.rank, line.stream, line.text) for line in lines] == [(0, "stderr", "full")]
    assert hub.dispatch(0, "bar", {**base, "id": 1, "text": "gone", "closed": True, "leave": False}) == []
    assert [line.text for line in hub.end_rank(1)] == ["half"]  # rank 1 ended with its bar open
    assert hub.dispatch(0, "future-kind", {}) == []
    unsubscribe()
    hub.dispatch(0, "metrics", {"step": 0})
    assert seen == [("bar", 0), ("bar", 1), ("bar", 0), ("bar", 0), ("bar", 1)]
    assert hub.metrics() == [{"step": 0}]
    # A bar per batch: only the newest closed bars are kept, open ones always.
    hub.dispatch(2, "bar", {**base, "id": 0, "text": "open", "closed": False, "leave": True})
    for i in range(1, 251):
        hub.dispatch(2, "bar", {**base, "id": i, "text": f"b{i}", "closed": True, "leave": False})
    kept = hub.bars(2)
    assert len(kept) == 101 and kept[0].text == "open" and [b.id for b in kept[1:]] == list(range(151, 251))


def test_apply_usage_keeps_peaks() -> None:
    from notebook_accel.launch.handle import RankStatus

    status = RankStatus(0, 1, "running", 0.0, rss=100, peak_rss=150)
    apply_usage(status, {"cuda_allocated": 10, "cuda_reserved": 20, "cuda_peak": 15})
    apply_usage(status, {"cuda_allocated": 5, "cuda_peak": 5, "peak_rss": 120, "rss": 130})
    assert (status.cuda_allocated, status.cuda_reserved, status.cuda_peak) == (5, 20, 15)
    assert (status.rss, status.peak_rss) == (130, 150)
    apply_usage(status, {"rss": 400})
    assert status.peak_rss == 400  # never below the resident memory seen


def test_a_sample_of_an_exited_unreaped_worker_keeps_its_figures() -> None:
    """A zombie reads as 0 bytes resident: such a sample must not replace what the rank reported as it ended."""
    import os
    import time

    from notebook_accel.launch.handle import RankStatus
    from notebook_accel.launch.usage import UsageSampler

    pid = os.fork()
    if pid == 0:
        time.sleep(0.5)
        os._exit(0)
    sampler = UsageSampler()
    try:
        status = RankStatus(0, pid, "running", 0.0)
        sampler.sample(status)  # alive: real figures
        assert status.rss and status.rss > 0 and status.cpu_percent is not None
        apply_usage(status, {"rss": 12345, "peak_rss": 67890, "cpu_percent": 42.0})  # its final report
        before = (status.rss, status.peak_rss, status.cpu_percent)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # wait until it is a zombie (exited, not reaped)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        sampler.sample(status)
        assert (status.rss, status.peak_rss, status.cpu_percent) == before
        assert before[0] == 12345 and before[2] == 42.0
    finally:
        os.waitpid(pid, 0)


def test_notebook_tracker_outside_a_launch_keeps_the_records() -> None:
    import torch

    tracker = NotebookTracker("run")
    assert send_event("metrics", {"step": 0}) is False  # no launcher to send to
    tracker.store_init_configuration({"lr": 0.1})
    tracker.log({"loss": torch.tensor(0.5), "acc": 1, "image": object()})
    tracker.log({"loss": 0.25})
    tracker.log({"loss": 0.1}, step=10)
    assert tracker.metrics == [
        {"step": 0, "loss": 0.5, "acc": 1},
        {"step": 1, "loss": 0.25},
        {"step": 10, "loss": 0.1},
    ]
    assert tracker.config == {"lr": 0.1} and tracker.tracker is tracker.metrics


def test_log_with_notebook_beside_other_trackers(tmp_path) -> None:  # noqa: ANN001
    from notebook_accel import Accelerator
    from notebook_accel.utils import LoggerType

    assert "notebook" not in {t.value for t in LoggerType}  # Accelerate's enum is left as it is
    assert filter_trackers("notebook") == ["notebook"]
    with pytest.raises(
        ValueError, match=r"log_with='nope' is not a known tracker; choose from \[.*'notebook'"
    ):
        filter_trackers("nope")
    mine = NotebookTracker("mine")
    accelerator = Accelerator(cpu=True, log_with=["notebook", "jsonl", mine], project_dir=tmp_path)
    accelerator.init_trackers("run")
    accelerator.log({"loss": 2.0}, step=3)
    assert accelerator.get_tracker("notebook").metrics == [{"step": 3, "loss": 2.0}]
    assert mine.metrics == [{"step": 3, "loss": 2.0}]
    assert '"loss": 2.0' in (tmp_path / "run" / "metrics.jsonl").read_text()
    accelerator.end_training()


def test_device_figures_wait_for_a_fully_imported_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from notebook_accel.launch.usage import _cuda_figures

    # A spawned worker's reporter thread may wake while the main thread is still importing torch.
    monkeypatch.setitem(sys.modules, "torch.cuda", types.ModuleType("torch.cuda"))
    assert _cuda_figures() is None
    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        memory_allocated=lambda: 10,
        memory_reserved=lambda: 20,
        max_memory_allocated=lambda: 15,
    )
    monkeypatch.setitem(sys.modules, "torch.cuda", fake)
    assert _cuda_figures() == {"cuda_allocated": 10, "cuda_reserved": 20, "cuda_peak": 15}
    fake.is_initialized = lambda: False
    assert _cuda_figures() is None


def _accelerate_tqdm_loop(steps: int) -> int:
    from notebook_accel.utils import tqdm

    total = 0
    for i in tqdm(range(steps), desc="main only"):
        total += i
    return total


def test_notebook_accel_utils_tqdm_shows_the_main_process_bar_only() -> None:
    handle = _launch(_accelerate_tqdm_loop, (STEPS,), progress_bars="all")
    assert handle.result() == [sum(range(STEPS))] * 2
    (bar,) = handle.bars()  # rank 1's bar is disabled by main_process_only: it never shows
    assert (bar.rank, bar.n, bar.total, bar.closed) == (0, STEPS, STEPS, True)
    assert [line.text for line in handle.lines(0)] == [bar.text] and "1000/1000" in bar.text
    assert handle.lines(1) == []


def test_utils_tqdm_stays_the_function_after_its_module_is_imported() -> None:
    import subprocess

    # A fresh interpreter: which of the two gets bound depends on what was imported before.
    code = (
        "import notebook_accel.utils.modeling\n"  # runs `from .tqdm import tqdm`
        "from notebook_accel.utils import tqdm\n"
        "import sys, types\n"
        "assert callable(tqdm) and not isinstance(tqdm, types.ModuleType), tqdm\n"
        "assert isinstance(sys.modules['notebook_accel.utils.tqdm'], types.ModuleType)\n"
        "print(list(tqdm(range(3), disable=True)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[0, 1, 2]", out.stderr[-2000:]


def test_bars_mode_is_chosen_while_another_thread_imports_ipython(monkeypatch) -> None:
    # A panel's first view imports ipywidgets, and with it IPython, in the caller's thread; a restart
    # starting then asks kernel_display() on the supervising thread, and sees IPython half imported
    # (no get_ipython yet). That is not a kernel: no live cell bars, and the restart goes on (it did
    # not: "restart 1 could not start (AttributeError(... partially initialized module 'IPython'"))."
    monkeypatch.setitem(sys.modules, "IPython", types.ModuleType("IPython"))
    assert kernel_display() is None
    assert _resolve_bars("auto", False) == (False, None)
