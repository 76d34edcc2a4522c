"""The one hang rule (``launch/hangs.py``) and its reports, on synthetic stacks (no process started).

Launched ranks (tests/test_faults.py) and interactive ones (tests/test_interactive_hangs.py) apply
this same rule to real processes.
"""

from __future__ import annotations

import linecache
import os
import sysconfig
import threading
import time

import pytest

from notebook_accel.launch.doctor import Frame, RankStack, ThreadStack, classify_wait, describe_stacks
from notebook_accel.launch.hangs import (
    GRACE_SECONDS,
    ProgressWatch,
    SampledWatch,
    StackSampler,
    Verdict,
    give_up_reason,
    launch_outcome,
    report_text,
)

TORCH = os.path.join(os.sep, "env", "site-packages", "torch")
C10D = os.path.join(TORCH, "distributed", "distributed_c10d.py")
CUDA = os.path.join(TORCH, "cuda", "__init__.py")
STREAMS = os.path.join(TORCH, "cuda", "streams.py")
CELL = "<rank cell 901>"
CELL_LINES = [
    "loss = model(batch)\n",  # 1
    "total = loss.item()\n",  # 2
    "work = dist.all_reduce(t, async_op=True)\n",  # 3
    "work.wait()\n",  # 4
    "time.sleep(10)\n",  # 5
    "host = t.to('cpu')\n",  # 6
    "items = t.tolist()\n",  # 7
]
linecache.cache[CELL] = (sum(map(len, CELL_LINES)), None, CELL_LINES, CELL)


def _frames(*spec: tuple[str, int, str]) -> tuple[Frame, ...]:
    return tuple(Frame(*s) for s in spec)


def _stack(
    rank: int,
    *spec: tuple[str, int, str],
    io: int | None = 1000,
    dump: str = "d" * 10,
    node: str | None = None,
) -> RankStack:
    return RankStack(rank, 100 + rank, (ThreadStack("0x1", True, _frames(*spec)),), dump, io=io, node=node)


@pytest.mark.parametrize(
    ("frames", "device_sync", "expected"),
    [
        ([(C10D, 10, "barrier"), (CELL, 1, "<module>")], False, "barrier"),
        ([(C10D, 10, "recv"), (CELL, 1, "<module>")], True, "recv"),
        ([(CUDA, 5, "synchronize"), (CELL, 1, "<module>")], True, "torch.cuda.synchronize"),
        ([(STREAMS, 5, "synchronize"), (CELL, 1, "<module>")], True, "torch.cuda.synchronize"),
        ([(CUDA, 5, "synchronize"), (CELL, 1, "<module>")], False, None),  # gloo: a CUDA sync is no wait
        ([(CELL, 2, "<module>")], True, ".item()"),  # a C call: only the user's line shows it
        ([(CELL, 4, "<module>")], True, ".wait()"),
        ([(CELL, 6, "<module>")], True, '.to("cpu")'),
        ([(CELL, 7, "<module>")], True, ".tolist()"),
        ([(CELL, 2, "<module>")], False, None),  # on CPU an .item() returns at once: computing
        ([(CELL, 1, "<module>")], True, None),  # a forward pass: computing
        ([(CELL, 5, "<module>")], True, None),  # sleeping: busy, as far as a stack can tell
        # a user line inside the library (not the innermost frame) says nothing
        ([(os.path.join(TORCH, "nn", "modules", "module.py"), 2, "forward"), (CELL, 2, "f")], True, None),
        ([(os.path.join(sysconfig.get_paths()["stdlib"], "threading.py"), 2, "wait")], True, None),
    ],
)
def test_classify_wait(frames, device_sync, expected) -> None:
    assert classify_wait(_frames(*frames), device_sync) == expected
    assert _stack(0, *frames).collective(device_sync) == expected


def _watch(timeout: float = 5.0) -> ProgressWatch:
    return ProgressWatch(timeout, started=0.0)


def test_a_sample_waits_for_a_second_of_silence_and_none_is_due_without_a_timeout_or_an_idle_rank() -> None:
    watch = _watch()
    assert not watch.due(GRACE_SECONDS - 0.1, 0.0, None)
    assert watch.due(GRACE_SECONDS, 0.0, None)
    assert not watch.due(5.0, 4.5, None)  # a line half a second ago
    assert not ProgressWatch(float("inf"), 0.0).due(100.0, 0.0, None)
    assert ProgressWatch(float("inf"), 0.0).due(100.0, 0.0, idle_since=50.0)


def test_every_rank_waiting_without_progress_is_a_deadlock_after_hang_timeout_only() -> None:
    watch = _watch(5.0)
    waiting = {0: _stack(0, (C10D, 10, "recv"), (CELL, 1, "<module>")), 1: _stack(1, (C10D, 10, "recv"))}
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 5.9):
        assert watch.observe(now, waiting, {0, 1}, idle=False, last_sign=0.0) is None
    verdict = watch.observe(6.0, waiting, {0, 1}, idle=False, last_sign=0.0)
    assert (
        verdict is not None
        and verdict.kind == "deadlock"
        and verdict.where == "rank 0 in recv, rank 1 in recv"
    )


def test_one_byte_moved_between_samples_is_progress() -> None:
    # The rank's stacks answers are left out of ``io`` (doctor.io_bytes), so the rule asks for no slack.
    def verdicts(moved_per_sample: int) -> list:
        watch = _watch(3.0)
        out = []
        for i, now in enumerate((1.0, 2.0, 3.0, 4.0, 5.0)):
            stacks = {r: _stack(r, (C10D, 10, "recv"), io=1000 + moved_per_sample * i) for r in (0, 1)}
            out.append(watch.observe(now, stacks, {0, 1}, idle=False, last_sign=0.0))
        return [v.kind for v in out if v is not None]

    assert verdicts(0)[:1] == ["deadlock"]
    assert verdicts(1) == []


def test_a_wait_moving_bytes_or_lines_is_progress() -> None:
    watch = _watch(2.0)
    for i, now in enumerate(range(1, 10)):
        stacks = {r: _stack(r, (C10D, 10, "all_reduce"), io=1000 + 100 * i) for r in (0, 1)}
        assert watch.observe(float(now), stacks, {0, 1}, idle=False, last_sign=0.0) is None
    stalled = {r: _stack(r, (C10D, 10, "all_reduce"), io=1000) for r in (0, 1)}
    watch = _watch(2.0)
    for now in range(1, 10):  # a line now and then: not stuck
        assert watch.observe(float(now), stalled, {0, 1}, idle=False, last_sign=now - 0.5) is None


def test_a_busy_rank_is_reported_once_and_never_given_up() -> None:
    watch = _watch(5.0)
    stacks = {0: _stack(0, (CELL, 5, "<module>")), 1: _stack(1, (C10D, 10, "barrier"))}
    verdicts = [watch.observe(float(now), stacks, {0, 1}, idle=False, last_sign=0.0) for now in range(1, 60)]
    reports = [v for v in verdicts if v is not None]
    assert [v.kind for v in reports] == ["report"]
    assert reports[0].busy == (0,) and reports[0].waited >= 5.0
    text = report_text(reports[0], "so it goes on")
    assert text.startswith("rank 1 in barrier (for 5 s) while rank(s) [0] are busy; so it goes on.\n")
    assert "Where each rank was:\n  rank 0: in <module> at <rank cell 901>:5 (time.sleep(10))" in text
    assert "  rank 1: in barrier (distributed_c10d.py:10)" in text
    assert "Stacks of rank 0 (pid 100)" in text and "Stacks of rank 1" not in text


def test_waiting_for_an_idle_rank_is_given_up_at_the_second_stalled_sample() -> None:
    watch = _watch(60.0)
    stacks = {0: _stack(0, (C10D, 10, "barrier"))}
    assert watch.observe(1.0, stacks, {0}, idle=True, last_sign=0.0) is None
    verdict = watch.observe(1.5, stacks, {0}, idle=True, last_sign=0.0)
    assert verdict is not None and verdict.kind == "broken" and verdict.where == "rank 0 in barrier"


def test_a_stack_that_could_not_be_taken_never_counts_as_waiting() -> None:
    watch = _watch(1.0)
    stacks = {0: _stack(0, (C10D, 10, "recv")), 1: RankStack(1, 101, (), "", answered=False)}
    verdicts = [watch.observe(float(now), stacks, {0, 1}, idle=False, last_sign=0.0) for now in range(1, 20)]
    assert all(v is None or v.kind == "report" for v in verdicts)


def test_samples_thin_out_while_a_rank_is_busy() -> None:
    watch = _watch(60.0)  # quiet: 6 s
    busy = {0: _stack(0, (CELL, 1, "<module>")), 1: _stack(1, (CELL, 1, "<module>"))}
    now, times = 1.0, []
    for _ in range(8):
        watch.observe(now, busy, {0, 1}, idle=False, last_sign=0.0)
        step = 0.01
        while not watch.due(now + step, 0.0, None):
            step += 0.01
        now += step
        times.append(round(step, 1))
    assert times == [1.0, 2.0, 4.0, 6.0, 6.0, 6.0, 6.0, 6.0]


def test_on_nccl_a_rank_stuck_in_a_sync_after_a_peer_raised_is_given_up() -> None:
    watch = ProgressWatch(60.0, started=0.0, device_sync=True)
    stacks = {0: _stack(0, (CELL, 2, "<module>"))}  # rank 0 in loss.item(): its all_reduce never completes
    assert watch.observe(1.0, stacks, {0}, idle=True, last_sign=0.0, raised=True) is None
    verdict = watch.observe(1.5, stacks, {0}, idle=True, last_sign=0.0, raised=True)
    assert verdict is not None and verdict.kind == "broken" and verdict.where == "rank 0 in .item()"


def test_a_gpu_bound_loop_waiting_in_item_most_of_the_time_is_never_given_up() -> None:
    watch = ProgressWatch(5.0, started=0.0, device_sync=True)
    stacks = {r: _stack(r, (CELL, 2, "<module>")) for r in (0, 1)}  # every sample lands in .item()
    assert [watch.observe(float(now), stacks, {0, 1}, idle=False, last_sign=0.0) for now in range(1, 40)] == [
        None
    ] * 39
    alone = ProgressWatch(5.0, started=0.0, device_sync=True)  # %%ranks 0: rank 1 not asked
    one = {0: stacks[0]}
    assert [alone.observe(float(now), one, {0}, idle=True, last_sign=0.0) for now in range(1, 40)] == [
        None
    ] * 39


def test_a_rank_first_seen_waiting_is_counted_from_then_and_a_completed_wait_starts_afresh() -> None:
    watch = _watch(10.0)
    busy = {0: _stack(0, (CELL, 5, "<module>")), 1: _stack(1, (CELL, 1, "<module>"))}
    assert watch.observe(5.0, busy, {0, 1}, idle=False, last_sign=0.0) is None
    waits = {**busy, 1: _stack(1, (C10D, 10, "barrier"), (CELL, 3, "<module>"))}
    # Seen busy at 5 s and waiting from 12 s: it has waited 10 s only at 22 s, not at 15.
    assert all(watch.observe(t, waits, {0, 1}, idle=False, last_sign=0.0) is None for t in (12.0, 15.0, 21.5))
    verdict = watch.observe(22.0, waits, {0, 1}, idle=False, last_sign=0.0)
    assert verdict is not None and verdict.kind == "report" and verdict.waited == 10.0
    # Bytes moved between two samples in the same barrier: that one completed, the next is a new wait.
    watch = _watch(10.0)
    assert watch.observe(1.0, waits, {0, 1}, idle=False, last_sign=0.0) is None
    moved = {**waits, 1: _stack(1, (C10D, 10, "barrier"), (CELL, 3, "<module>"), io=5000)}
    assert watch.observe(10.5, moved, {0, 1}, idle=False, last_sign=0.0) is None
    assert watch.observe(11.5, moved, {0, 1}, idle=False, last_sign=0.0) is None  # 1 s, not 10.5
    assert watch.observe(20.5, moved, {0, 1}, idle=False, last_sign=0.0).kind == "report"


def _on_nodes() -> dict[int, RankStack]:
    """Rank 0 on n1 busy (sleeping), ranks 1 (n1) and 3 (n2) in a barrier."""
    return {
        0: _stack(0, (CELL, 5, "<module>"), node="n1"),
        1: _stack(1, (C10D, 10, "barrier"), (CELL, 3, "<module>"), node="n1"),
        3: _stack(3, (C10D, 10, "barrier"), (CELL, 3, "<module>"), node="n2"),
    }


def test_every_report_and_error_names_each_ranks_node() -> None:
    stacks = _on_nodes()
    watch = _watch(2.0)
    verdicts = [watch.observe(float(t), stacks, {0, 1, 3}, idle=False, last_sign=0.0) for t in range(1, 5)]
    report = next(v for v in verdicts if v is not None)
    assert report.where == "rank 1 (n1) in barrier, rank 3 (n2) in barrier"
    text = report_text(report, "so it goes on")
    assert "while rank(s) 0 (n1) are busy" in text
    for line in ("  rank 0 (n1): in <module>", "  rank 1 (n1): in barrier", "  rank 3 (n2): in barrier"):
        assert line in text, text
    assert "Stacks of rank 0 (pid 100, on n1):" in text
    # The deadlock error, the stop/timeout/interrupt stacks and the launch's texts: the same renderer.
    waiting = {r: s for r, s in stacks.items() if r != 0}
    deadlock = Verdict("deadlock", "rank 1 (n1) in barrier, rank 3 (n2) in barrier", waiting, waited=2.0)
    reason = give_up_reason(deadlock, 2.0)
    assert reason.startswith(
        "deadlock: no rank has made progress for hang_timeout=2 s: rank 1 (n1) in barrier"
    )
    where = describe_stacks(stacks)
    assert "Stacks of rank 1 (pid 101, on n1):" in where and "Stacks of rank 3 (pid 103, on n2):" in where
    shown, why = launch_outcome(deadlock, 2.0, "report", [], {1: "n1", 3: "n2"})
    assert why == reason and "  rank 3 (n2): in barrier" in shown and "on n2):" in shown
    broken = Verdict("broken", "rank 3 (n2) in barrier", {3: stacks[3]})
    shown, why = launch_outcome(broken, 2.0, "report", [0], {0: "n1", 3: "n2"})
    assert why.startswith(
        "rank 3 (n2) in barrier waits for rank(s) 0 (n1), which returned: a rank that has ended"
    )
    assert "cannot go on" in why and "Stacks of rank 3 (pid 103, on n2):" in shown


def test_a_launch_goes_on_at_the_report_unless_on_hang_is_stop() -> None:
    report = Verdict("report", "rank 1 in barrier", _on_nodes(), busy=(0,), waited=7.2)
    text, why = launch_outcome(report, 5.0, "report", [], {})
    assert why is None
    assert text.startswith(
        "rank 1 in barrier (for 7 s) while rank(s) 0 (n1) are busy; a busy rank is not a hang, so the launch "
        'goes on (on_hang="stop" would stop it here). It is ended only when no rank has made progress for '
        "hang_timeout=5 s.\nWhere each rank was:"
    )
    text, why = launch_outcome(report, 5.0, "stop", [], {})
    assert (
        why
        == 'at the hang report (on_hang="stop"): rank 1 in barrier waited 7 s while rank(s) 0 (n1) were busy'
    )
    assert 'on_hang="stop" stops the launch at this report.' in text


def test_the_sampled_watch_never_waits_for_a_sample_and_judges_it_when_it_lands() -> None:
    release = threading.Event()
    waiting = {r: _stack(r, (C10D, 10, "recv")) for r in (0, 1)}

    def take() -> dict[int, RankStack]:
        release.wait(30)  # a rank slow to answer
        return waiting

    watch = SampledWatch(1.0, started=0.0, take=take)
    now = time.monotonic()
    began = time.perf_counter()
    assert watch.check(now, [0, 1], last_sign=0.0, idle_since=None) is None  # due: a sample starts
    assert watch.sampler.running and time.perf_counter() - began < 0.5  # in a thread of its own
    assert watch.check(now + 0.1, [0, 1], last_sign=0.0, idle_since=None) is None  # still being taken
    verdicts = []
    release.set()
    deadline = time.monotonic() + 30
    while not verdicts and time.monotonic() < deadline:
        watch.sampler.join(5)
        now = max(now, time.monotonic()) + 1.0  # one second later each time: the next sample is due
        verdict = watch.check(now, [0, 1], last_sign=0.0, idle_since=None)
        verdicts += [verdict] if verdict is not None else []
    assert [v.kind for v in verdicts] == ["deadlock"], verdicts


def test_a_failing_sample_is_no_sample() -> None:
    def take() -> dict[int, RankStack]:
        raise OSError("the stacks directory is gone")

    sampler = StackSampler(take)
    sampler.start()
    sampler.join(10)
    when, stacks = sampler.result()
    assert stacks == {} and sampler.result() is None


_NEWER_THREAD = (
    "Thread 0x00007f0000000002 (most recent call first):\n"
    '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
    '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
)
_MAIN_THREAD = (
    "Current thread 0x00007f0000000001 (most recent call first):\n"
    '  File "/work/t.py", line 3 in _marker_sleep\n'
    '  File "/site/notebook_accel/launch/worker.py", line 321 in worker_main\n'
)


def test_a_dump_paused_before_the_main_thread_is_read_once_the_main_thread_came(tmp_path):
    """faulthandler writes the worker's main thread last: a dump paused before it (a busy machine) is not cut."""
    from notebook_accel.launch import doctor

    path = tmp_path / "rank_0.txt"
    path.write_text("")

    def write_slowly():
        with open(path, "a") as f:
            f.write(_NEWER_THREAD)
            f.flush()
            time.sleep(0.15)  # far longer than the settle time of a complete dump
            f.write(_MAIN_THREAD)

    writer = threading.Thread(target=write_slowly)
    writer.start()
    texts = doctor._wait_for_dumps({0: str(path)}, {0: 0})
    writer.join()
    assert texts[0] == _NEWER_THREAD + _MAIN_THREAD
    assert (
        RankStack(0, 1, doctor.parse_dump(texts[0]), texts[0], 0.0).main.frames[0].function == "_marker_sleep"
    )


def test_a_dump_without_the_workers_main_line_is_taken_once_quiet(tmp_path):
    from notebook_accel.launch import doctor

    path = tmp_path / "rank_0.txt"
    path.write_text(_NEWER_THREAD)
    start = time.monotonic()
    assert doctor._wait_for_dumps({0: str(path)}, {0: 0}) == {0: _NEWER_THREAD}
    assert doctor._QUIET_SECONDS <= time.monotonic() - start < doctor._ANSWER_SECONDS
