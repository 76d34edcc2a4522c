"""The rank's answer to a stack request (``launch/stackdump.py``): safe while its threads run, in faulthandler's format."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from notebook_accel.launch.doctor import StackCollector, parse_dump
from notebook_accel.launch.stackdump import MAX_FRAMES, answerer, ask, format_stacks
from notebook_accel.launchers import notebook_launcher


def _deep(n: int) -> int:
    return 0 if n == 0 else _deep(n - 1) + 1


def _churn(until: float) -> None:
    while time.monotonic() < until:
        _deep(400)  # deeper than one frame chunk: returning frees frame memory


def _threads_calling_deep(seconds: float) -> int:
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=_churn, args=(until,), name=f"churn-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    while time.monotonic() < until:  # threads come and go too
        short = threading.Thread(target=_deep, args=(50,))
        short.start()
        short.join()
    for thread in threads:
        thread.join()
    return int(os.environ["RANK"])


def _live_stacks(handle) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not handle.done:
        stacks = handle.stacks()
        if stacks and all(s.answered for s in stacks.values()):
            return stacks
        time.sleep(0.05)
    raise AssertionError(f"the ranks never answered: {handle.stacks()}")


def _flood(handle, seconds: float) -> int:
    sent, until = 0, time.monotonic() + seconds
    collector = handle._collector
    while time.monotonic() < until:
        for rank in (0, 1):
            sent += ask(collector.path(rank))
        time.sleep(0.002)
    return sent


def test_ranks_whose_threads_run_python_live_through_hundreds_of_stack_requests():
    # faulthandler's all-threads dump from a signal handler read these threads' freed frames and the
    # rank died of SIGSEGV within a few requests (the suite's "Fatal Python error: Segmentation fault").
    handle = notebook_launcher(_threads_calling_deep, args=(6.0,), num_processes=2, block=False, sinks=[])
    _live_stacks(handle)
    sent = _flood(handle, 2.0)
    taken = [handle.stacks() for _ in range(10)]
    assert handle.result(timeout=60) == [0, 1]
    assert sent > 200
    answered = [s for round_ in taken for s in round_.values() if s.answered]
    assert answered, taken
    names = {f.function for s in answered for t in s.threads for f in t.frames}
    assert {"_threads_calling_deep", "_churn", "_deep"} <= names
    assert all(s.main.runs_the_function for s in answered)


_ANSWERING = """
import sys, time
sys.path.insert(0, {root!r})
from notebook_accel.launch.stackdump import start_answering
def waiting_here():
    time.sleep(60)
start_answering({path!r})
print("ready", flush=True)
waiting_here()
"""


def test_ask_gets_an_answer_never_blocks_and_says_when_no_rank_listens(tmp_path):
    path = str(tmp_path / "rank_0.txt")
    assert not ask(path)  # no pipe
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", _ANSWERING.format(root=root, path=path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n" and os.path.exists(path)
        started = time.monotonic()
        assert all(ask(path) for _ in range(100_000))  # far more than a pipe holds: none blocks
        assert time.monotonic() - started < 30
        deadline = time.monotonic() + 30
        while "in waiting_here" not in open(path).read() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = open(path).read()
        main = parse_dump(text)[-1]
        assert [f.function for f in main.frames[:2]] == ["waiting_here", "<module>"]
        assert "notebook_accel-stacks" not in text  # the answering thread leaves itself out
    finally:
        proc.kill()
        proc.wait()
    assert not ask(path)  # the pipe is there, its reader gone


def test_taking_a_ranks_stacks_is_not_counted_as_its_io():
    # The hang rule reads any byte a waiting rank moves as progress: its answers must not count.
    collector = StackCollector()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _ANSWERING.format(root=root, path=collector.path(0))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        assert answerer(collector.path(0)) is not None
        taken = [collector.collect({0: proc.pid})[0] for _ in range(5)]
        assert all(stack.answered for stack in taken)
        assert len({stack.io for stack in taken}) == 1, [stack.io for stack in taken]  # 5 answers, no byte
        assert all(len(stack.dump) > 100 for stack in taken)  # what it wrote each time, left out
    finally:
        proc.kill()
        proc.wait()
        collector.close()


def _wait_in(event: threading.Event, depth: int) -> None:
    if depth:
        _wait_in(event, depth - 1)
    else:
        event.wait(30)


def test_format_stacks_writes_what_parse_dump_reads_main_thread_last():
    event = threading.Event()
    shallow = threading.Thread(target=_wait_in, args=(event, 2), name="shallow-waiter")
    deep = threading.Thread(target=_wait_in, args=(event, MAX_FRAMES + 20), name="deep-waiter")
    shallow.start()
    deep.start()
    time.sleep(0.2)
    try:
        text = format_stacks(skip=deep.ident)
        everything = format_stacks()
    finally:
        event.set()
        shallow.join()
        deep.join()
    threads = parse_dump(text)
    by_ident = {int(t.ident, 16): t for t in threads}
    assert deep.ident not in by_ident and shallow.ident in by_ident
    assert int(threads[-1].ident, 16) == threading.main_thread().ident  # faulthandler's order
    assert f"Thread 0x{shallow.ident:016x} [shallow-waiter] (most recent call first):" in text
    frames = by_ident[shallow.ident].frames
    assert [f.function for f in frames[:4]] == ["wait", "wait", "_wait_in", "_wait_in"]  # innermost first
    assert frames[0].filename == threading.__file__
    deep_stack = {int(t.ident, 16): t for t in parse_dump(everything)}[deep.ident]
    assert len(deep_stack.frames) == MAX_FRAMES
    assert "  ...\n" in everything
