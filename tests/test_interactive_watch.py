"""The wait classifier and the interactive ranks' progress rule, on synthetic stacks (no process started)."""

from __future__ import annotations

import linecache
import os
import sysconfig

import pytest

from notebook_accel.interactive.watch import GRACE_SECONDS, ProgressWatch, report_text
from notebook_accel.launch.doctor import Frame, RankStack, ThreadStack, classify_wait

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


def _stack(rank: int, *spec: tuple[str, int, str], io: int | None = 1000, dump: str = "d" * 10) -> RankStack:
    return RankStack(rank, 100 + rank, (ThreadStack("0x1", True, _frames(*spec)),), dump, io=io)


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
    text = report_text(reports[0], 5.0)
    assert "rank 1 in barrier" in text and "while rank(s) [0] are busy" in text
    assert "Stacks of rank 0" in text and "Stacks of rank 1" not in text


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
