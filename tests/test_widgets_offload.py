"""OffloadMonitor on a real disk-offloaded model: placement, per-pass loads/bytes/time, throttled view."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from notebook_accel.widgets import OffloadMonitor
from notebook_accel.widgets._base import _Throttle

from notebook_accel import cpu_offload, disk_offload, telemetry


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 4))


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_disk_offloaded_model(tmp_path):
    reference = _model()
    expected = reference(torch.ones(2, 32))
    nbytes = _weight_bytes(reference)
    model = disk_offload(reference, tmp_path, execution_device="cpu")
    mon = OffloadMonitor(model)
    try:
        assert set(mon.placement) == {"0", "2", "3"}
        assert {info["storage"] for info in mon.placement.values()} == {"disk"}
        assert mon.storage_summary() == {"disk": {"modules": 3, "nbytes": nbytes}}
        view = mon.widget
        assert mon._w_status.value == "waiting for a forward pass"
        for _ in range(3):
            torch.testing.assert_close(model(torch.ones(2, 32)), expected)
        passes = mon.finished_passes()
        assert [p.index for p in passes] == [1, 2, 3]
        for p in passes:
            assert p.loads == 3 and p.bytes_moved >= nbytes
            assert p.wall_seconds > 0 and 0 <= p.move_seconds <= p.wall_seconds
            assert p.compute_seconds == pytest.approx(p.wall_seconds - p.move_seconds)
            assert p.modules >= {"0", "2", "3"}
        assert {name: int(t["loads"]) for name, t in mon.module_totals.items()} == {"0": 3, "2": 3, "3": 3}
        mon._throttle.flush()
        assert "3 passes" in mon._w_status.value and "<table>" in mon._w_passes.value
        assert "disk: 3 modules" in mon._w_summary.value
        assert mon._w_chart.value[:4] == b"\x89PNG"
        text = repr(mon)
        assert "3 passes" in text and "bytes moved" in text
        page = mon._repr_html_()
        assert "OffloadMonitor" in page and "data:image/png;base64," in page
        mon._w_reset.click()
        assert mon.finished_passes() == [] and mon.module_totals == {}
        assert mon._w_status.value == "waiting for a forward pass"
        assert view is mon.widget
    finally:
        mon.close()
    assert not telemetry.has_subscribers()
    model(torch.ones(2, 32))
    assert mon.finished_passes() == []  # closed: no longer recording
    mon.close()  # idempotent


def test_cpu_offload_and_live_updates_are_throttled():
    model = cpu_offload(_model(), execution_device="cpu")
    mon = OffloadMonitor(model, interval=0.2)
    try:
        assert mon.widget is not None
        calls_before = mon._throttle.calls
        start = time.monotonic()
        for _ in range(30):
            model(torch.ones(1, 32))
        elapsed = time.monotonic() - start
        # One redraw per 0.2 s window at most, however many passes ran in it.
        assert mon._throttle.calls - calls_before <= 1 + elapsed / 0.2
        time.sleep(0.4)
        assert "30 passes" in mon._w_status.value
        assert {info["storage"] for info in mon.placement.values()} == {"cpu"}
    finally:
        mon.close()


def test_throttle_delivers_the_trailing_call():
    seen = []
    throttle = _Throttle(lambda: seen.append(time.monotonic()), interval=0.5)
    for _ in range(50):
        throttle()
    assert len(seen) == 1
    time.sleep(0.8)
    assert len(seen) == 2  # the trailing call, once the window closed
    assert seen[1] - seen[0] >= 0.45
    deferred = _Throttle(lambda: seen.append(0), interval=0.05, defer=True)
    deferred()
    assert len(seen) == 2  # never in the caller's thread
    time.sleep(0.2)
    assert len(seen) == 3


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        OffloadMonitor("model")
    with pytest.raises(ValueError, match="max_passes must be >= 1"):
        OffloadMonitor(_model(), max_passes=0)


def test_streaming_figures_bandwidth_against_pinned_and_waiting_time():
    model = cpu_offload(_model(), execution_device="cpu")
    mon = OffloadMonitor(model, pinned_bandwidth=50e9)
    try:
        assert mon.pinned_bandwidth == 50e9 and "of 50.0 GB/s pinned" in repr(mon)
        now = time.perf_counter()

        def report(
            *_,
        ):  # what a GPU-streamed model reports, during a pass, once its copies and waits completed
            telemetry.emit(telemetry.HookEvent("transfer", "0", "cuda:0", "cpu", 2 * 10**9, 0.05, now, True))
            telemetry.emit(telemetry.HookEvent("wait", "", "cuda:0", "cuda:0", 0, 0.004, now, True))

        model(torch.ones(1, 32))
        handle = model[2].register_forward_pre_hook(report)
        model(torch.ones(1, 32))
        handle.remove()
        done = mon.finished_passes()
        assert done[-1].transfer_bytes == 2 * 10**9 and done[-1].achieved_bandwidth == pytest.approx(40e9)
        assert done[-1].wait_seconds == pytest.approx(0.004)
        p = done[-1]
        assert p.compute_seconds == pytest.approx(max(0.0, p.wall_seconds - p.move_seconds - p.wait_seconds))
        summary = mon.bandwidth_summary()
        assert summary["achieved"] == pytest.approx(40e9) and summary["of_pinned"] == pytest.approx(0.8)
        assert summary["waiting"] == pytest.approx(0.004)
        text = repr(mon)
        assert "host-to-device 40.0 GB/s (80%) of 50.0 GB/s pinned" in text and "H2D GB/s" in text
        assert "40.0" in mon._repr_html_()
    finally:
        mon.close()
    plain = OffloadMonitor(cpu_offload(_model(), execution_device="cpu"))
    try:
        assert plain.pinned_bandwidth is None and "host-to-device" not in repr(
            plain
        )  # not streaming to a GPU
    finally:
        plain.close()
