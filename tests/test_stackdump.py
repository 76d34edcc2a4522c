"""The rank's answer to a stack request (``launch/stackdump.py``): safe while its threads run, in faulthandler's format."""

from __future__ import annotations

import os
import signal
import threading
import time

from notebook_accel.launch.doctor import parse_dump
from notebook_accel.launch.stackdump import MAX_FRAMES, STACKS_SIGNAL, format_stacks
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


def _flood(pids: list[int], seconds: float) -> int:
    sent, until = 0, time.monotonic() + seconds
    while time.monotonic() < until:
        for pid in pids:
            try:
                os.kill(pid, STACKS_SIGNAL)
                sent += 1
            except ProcessLookupError:
                pass
        time.sleep(0.002)
    return sent


def test_ranks_whose_threads_run_python_live_through_hundreds_of_stack_requests():
    # faulthandler's all-threads dump from a signal handler read these threads' freed frames and the
    # rank died of SIGSEGV within a few requests (the suite's "Fatal Python error: Segmentation fault").
    handle = notebook_launcher(_threads_calling_deep, args=(6.0,), num_processes=2, block=False, sinks=[])
    stacks = _live_stacks(handle)
    sent = _flood([s.pid for s in stacks.values()], 2.0)
    taken = [handle.stacks() for _ in range(10)]
    assert handle.result(timeout=60) == [0, 1]
    assert sent > 200
    answered = [s for round_ in taken for s in round_.values() if s.answered]
    assert answered, taken
    names = {f.function for s in answered for t in s.threads for f in t.frames}
    assert {"_threads_calling_deep", "_churn", "_deep"} <= names
    assert all(s.main.runs_the_function for s in answered)


def _sleep_with_an_unblocked_thread(seconds: float) -> bool:
    def escaped() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACKS_SIGNAL})  # as code outside our block would be
        signal.pthread_kill(threading.get_ident(), STACKS_SIGNAL)  # the kernel rarely picks it by itself
        time.sleep(seconds)

    thread = threading.Thread(target=escaped)
    thread.start()
    time.sleep(seconds)
    thread.join()
    return STACKS_SIGNAL in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_request_that_reaches_a_thread_outside_the_block_does_not_end_the_rank():
    handle = notebook_launcher(
        _sleep_with_an_unblocked_thread, args=(4.0,), num_processes=1, block=False, sinks=[]
    )
    stacks = _live_stacks(handle)
    assert _flood([s.pid for s in stacks.values()], 1.5) > 100
    assert handle.result(timeout=60) == [True]  # the main thread keeps the signal blocked


def _fork_and_report() -> tuple[bool, int]:
    pid = os.fork()
    if pid == 0:
        plain = signal.getsignal(STACKS_SIGNAL) == signal.SIG_DFL
        unblocked = STACKS_SIGNAL not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os._exit(0 if plain and unblocked else 3)
    _, status = os.waitpid(pid, 0)
    return STACKS_SIGNAL in signal.pthread_sigmask(signal.SIG_BLOCK, []), os.waitstatus_to_exitcode(status)


def test_a_process_a_rank_forks_gets_the_signal_back_plain():
    assert notebook_launcher(_fork_and_report, num_processes=1, sinks=[]) == [(True, 0)]


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
