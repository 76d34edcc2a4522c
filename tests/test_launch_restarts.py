"""``notebook_launcher(max_restarts=k, monitor_interval=s)`` on one machine: real 2-rank gloo groups.

A rank failing on its first tries restarts the whole group; one handle (blocking or not) follows
the whole run: ``attempt``, ``restarts``, ``attempts``, lines tagged with their attempt, a
``"restart"`` event and an announcement per restart, the panel's "attempt 2/3", and the last
failure (with its traceback) when every try failed. A stop, a ^C or the timeout ends the run
without a restart; ``timeout`` covers the whole run.
"""

from __future__ import annotations

import io
import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from notebook_accel.launch import LaunchError, PrintSink
from notebook_accel.launch.restarts import RestartingHandle
from notebook_accel.launchers import notebook_launcher
from tests.launcher_helpers import Collect

pytestmark = pytest.mark.timeout(180)


def _count_try(counter_dir: str) -> tuple[int, int]:
    """Return (this rank, how many tries it made before this one), counting this try in ``counter_dir``."""
    rank = int(os.environ["RANK"])
    path = os.path.join(counter_dir, f"rank{rank}")
    tries = os.path.getsize(path) if os.path.exists(path) else 0
    with open(path, "a") as f:
        f.write("x")
    return rank, tries


def _flaky(counter_dir: str, failures: int, gate: str = "", sleeps: tuple = ()) -> tuple[int, float]:
    """Return (tries before this one, the group's all_reduce of 1.0); rank 1 raises on its first ``failures`` tries.

    Every try forms a real gloo group (a fresh rendezvous each time). With ``gate``, each try first
    waits for that file; ``sleeps[t]`` seconds are slept by try ``t`` before it fails or returns.
    """
    rank, tries = _count_try(counter_dir)
    print(f"try {tries}", flush=True)
    while gate and not os.path.exists(gate):
        time.sleep(0.02)
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    if tries < len(sleeps):
        time.sleep(sleeps[tries])
    if rank == 1 and tries < failures:
        raise ValueError(f"try {tries} fails")
    dist.barrier()
    dist.destroy_process_group()
    return tries, total.item()


def _tries(tmp_path, rank: int = 1) -> int:
    path = tmp_path / f"rank{rank}"
    return os.path.getsize(path) if path.exists() else 0


def _always_failing(tmp_path, monitor_interval: float) -> RestartingHandle:
    """Return the handle of a non-blocking launch of 2 ranks whose rank 1 fails each of its 3 tries."""
    return notebook_launcher(
        _flaky, args=(str(tmp_path), 99), num_processes=2, max_restarts=2, monitor_interval=monitor_interval,
        block=False, sinks=[],
    )  # fmt: skip


def _wait_for(cond, timeout: float = 60.0, handle=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            state = "" if handle is None else f": {handle!r} {handle.attempts} {handle.lines()[-6:]}"
            if handle is not None:  # where each live rank is, to tell a stuck start from a slow one
                state += "".join(f"\nrank {r}:\n{s.text}" for r, s in handle.stacks().items())
            raise AssertionError(f"condition not met in time{state}")
        time.sleep(0.02)


@pytest.mark.usefixtures("no_launch_leaks")
def test_block_false_handle_follows_the_restarts_until_a_try_succeeds(tmp_path):
    gate = tmp_path / "go"
    sink, out = Collect(), io.StringIO()
    handle = notebook_launcher(
        _flaky, args=(str(tmp_path), 2, str(gate)), num_processes=2, max_restarts=2,
        monitor_interval=0.05, block=False, sinks=[sink, PrintSink(stdout=out, stderr=out)],
    )  # fmt: skip
    assert isinstance(handle, RestartingHandle)
    events = []
    handle.subscribe_events(lambda kind, rank, state: events.append((kind, rank, state)))
    gate.touch()  # every try waits for it: the events of the first restart come after subscribing
    assert handle.result(timeout=120) == [(2, 2.0), (2, 2.0)]  # the third group succeeded
    assert handle.restarts == 2 and handle.attempt == 3
    first, second, third = handle.attempts
    assert [a.state for a in handle.attempts] == ["failed", "failed", "succeeded"]
    # (the exit code is the raising rank's: 1, or -15 when the stop of the group reached it first)
    assert (first.number, first.rank) == (1, 1) and first.exitcode in (1, -15)
    assert "ValueError: try 0 fails" in first.failure and "ValueError: try 1 fails" in second.failure
    assert "_flaky" in first.error.failures[0].traceback and third.error is None
    assert first.started_at <= first.ended_at <= second.started_at <= third.ended_at
    assert "attempt 1 failed at " in first.line() and first.line().endswith(f"(exit code {first.exitcode})")
    assert [s.attempt for s in handle.status()] == [3, 3]
    restarts = [state for kind, _, state in events if kind == "restart"]
    assert [a.number for a in restarts] == [1, 2]
    announced = [t for t in sink.announced if t.startswith("restarting the group")]
    assert len(announced) == 2 and "(restart 2 of 2) after rank 1" in announced[1]
    # Every line stays attributed to its rank and its try, in the handle, the sinks and the print.
    said = {(line.rank, line.attempt, line.text) for line in handle.lines() if line.text.startswith("try")}
    assert said == {(r, t + 1, f"try {t}") for r in (0, 1) for t in range(3)}
    assert {(li.rank, li.attempt, li.text) for li in sink.lines if li.text.startswith("try")} == said
    printed = out.getvalue().splitlines()
    assert "[rank 1] try 0" in printed and "[rank 1, attempt 2] try 1" in printed
    assert "[rank 0, attempt 3] try 2" in printed
    handle.wait()


@pytest.mark.usefixtures("no_launch_leaks")
def test_every_try_failing_raises_the_last_failure_with_its_traceback(tmp_path):
    handle = _always_failing(tmp_path, monitor_interval=0.05)
    with pytest.raises(LaunchError, match=r"rank 1 \(pid \d+\) ValueError: try 2 fails") as info:
        handle.result(timeout=120)
    error = info.value
    assert isinstance(error, ChildFailedError)
    assert "all 3 attempts failed (max_restarts=2)" in str(error)
    assert "Traceback of rank 1" in str(error) and "_flaky" in error.failures[0].traceback
    assert error.__cause__ is handle.attempts[-1].error
    assert [a.state for a in handle.attempts] == ["failed"] * 3 and handle.error is error
    assert _tries(tmp_path) == 3  # k + 1 tries, no more


@pytest.mark.usefixtures("no_launch_leaks")
def test_stop_during_the_wait_before_a_restart_ends_the_run(tmp_path):
    handle = _always_failing(tmp_path, monitor_interval=60)
    _wait_for(lambda: handle.restarting, 60, handle)
    assert handle.attempt == 1 and not handle.done
    handle.stop()
    assert handle.wait(timeout=30)  # the 60 s wait ended at once
    with pytest.raises(
        LaunchError, match=r"ValueError: try 0 fails.*stopped by the user before restart 1 of 2"
    ):
        handle.result()
    assert _tries(tmp_path) == 1 and handle.restarts == 0 and not handle.restarting


def _dies_with_3_when_interrupted(counter_dir: str) -> None:
    """Rank 1 fails its first try; from the second on, every rank exits with code 3 on SIGINT (a failure)."""
    rank, tries = _count_try(counter_dir)
    if tries == 0 and rank == 1:
        raise ValueError("try 0 fails")
    signal.signal(signal.SIGINT, lambda *_: os._exit(3))
    print("running", flush=True)
    time.sleep(120)


@pytest.mark.usefixtures("no_launch_leaks")
def test_stop_during_a_restarted_try_does_not_restart_again(tmp_path):
    handle = notebook_launcher(
        _dies_with_3_when_interrupted, args=(str(tmp_path),), num_processes=2, max_restarts=3,
        monitor_interval=0.05, block=False, sinks=[],
    )  # fmt: skip
    _wait_for(lambda: {li.rank for li in handle.lines() if li.attempt == 2} == {0, 1}, 60, handle)
    handle.stop()
    # The ranks die of the stop with exit code 3, a failure: still, a stopped run is not restarted.
    with pytest.raises(
        LaunchError, match="ExitCode: exited with code 3.*stopped by the user on attempt 2 of 4"
    ):
        handle.result(timeout=60)
    assert [a.state for a in handle.attempts] == ["failed", "failed"]
    assert _tries(tmp_path) == 2 and handle.restarts == 1


def test_block_true_restarts_into_the_same_log_files(tmp_path):
    sink = Collect()
    out = notebook_launcher(
        _flaky, args=(str(tmp_path), 1), num_processes=2, max_restarts=1, monitor_interval=0.05,
        sinks=[sink], log_dir=tmp_path / "logs", rdzv_id="run",
    )  # fmt: skip
    assert out == [(1, 2.0), (1, 2.0)]
    log = (tmp_path / "logs" / "run" / "rank_1" / "stdout.log").read_text().splitlines()
    assert log == ["try 0", "----- attempt 2 -----", "try 1"]
    assert (
        "restarting the group in 0.05 s (restart 1 of 1)"
        in (tmp_path / "logs" / "run" / "launch.txt").read_text()
    )


@pytest.mark.usefixtures("no_launch_leaks")
def test_interrupt_during_the_wait_before_a_restart_stops_a_blocking_run(tmp_path):

    def interrupt_soon(text: str) -> None:
        if text.startswith("restarting the group"):
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()

    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(
            _flaky, args=(str(tmp_path), 99), num_processes=2, max_restarts=2, monitor_interval=60,
            sinks=[Collect(interrupt_soon)],
        )  # fmt: skip
    assert _tries(tmp_path) == 1


def test_timeout_covers_the_whole_run_not_each_try(tmp_path):
    # Try 1 fails after 1.5 s, try 2 would succeed after 5 s: each alone fits in timeout=6, both do not.
    with pytest.raises(LaunchError, match=r"TimeoutError: still running after timeout=6.0 s") as info:
        notebook_launcher(
            _flaky, args=(str(tmp_path), 1, "", (1.5, 5.0)), num_processes=2, max_restarts=3,
            monitor_interval=0.05, timeout=6.0, sinks=[],
        )  # fmt: skip
    assert "on attempt 2 of 4" in str(info.value)
    assert _tries(tmp_path) == 2


def test_panel_shows_the_attempt_and_the_earlier_failures(tmp_path):
    from notebook_accel.widgets import LaunchPanel

    gate = tmp_path / "go"
    # Rank 1 fails its first two tries; the third waits for the gate, so the panel can be read mid-run.
    handle = notebook_launcher(
        _gated_third_try, args=(str(tmp_path), str(gate)), num_processes=2, max_restarts=2,
        monitor_interval=0.05, block=False, sinks=[],
    )  # fmt: skip
    panel = LaunchPanel(handle, interval=0.05)
    assert panel.widget is not None
    _wait_for(lambda: handle.attempt == 3 and any(li.attempt == 3 for li in handle.lines(1)), 60, handle)
    assert panel.attempt_text() == "attempt 3/3" and panel.state == "running"
    first, second = panel.restart_lines()
    assert (
        first.startswith("attempt 1 failed at ")
        and "rank 1 (pid" in first
        and "ValueError: try 0 fails" in first
    )
    assert (
        second.startswith("attempt 2 failed")
        and "try 1 fails" in second
        and re.search(r"\(exit code -?\d+\)$", second)
    )
    assert [row["attempt"] for row in panel.rows()] == [3, 3]
    _wait_for(lambda: "[rank 1, attempt 3] waiting" in panel.merged_lines())
    assert "[rank 1] waiting" in panel.merged_lines()  # the first try's line, still attributed to it
    _wait_for(lambda: "attempt 3/3" in panel._w_state.description)
    _wait_for(lambda: "try 1 fails" in panel._w_restarts.value)
    assert "attempt 3/3" in panel._repr_html_() and "attempt 2 failed" in repr(panel)
    gate.touch()
    assert handle.result(timeout=60) == [2, 2]
    _wait_for(lambda: panel._w_state.description == "succeeded (attempt 3/3)")
    assert panel.state == "succeeded" and panel.error_text() == ""
    panel.close()


def _gated_third_try(counter_dir: str, gate: str) -> int:
    rank, tries = _count_try(counter_dir)
    print("waiting", flush=True)
    if rank == 1 and tries < 2:
        raise ValueError(f"try {tries} fails")
    while not os.path.exists(gate):
        time.sleep(0.02)
    return tries


@pytest.mark.usefixtures("no_launch_leaks")
def test_interrupt_right_after_a_group_started_leaves_no_worker_behind(tmp_path, monkeypatch):
    from notebook_accel.launch.handle import LaunchHandle

    def interrupted(self, callback):  # ^C between the fork and the start of supervision
        raise KeyboardInterrupt

    monkeypatch.setattr(LaunchHandle, "subscribe_events", interrupted)
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(
            _flaky, args=(str(tmp_path), 0, str(tmp_path / "never")), num_processes=2, max_restarts=1,
            block=False, sinks=[],
        )  # fmt: skip
