"""The launcher under stress: very long lines, signals during output, bounded history, refused functions, failed forks."""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref

import pytest

from notebook_accel.launch import output as output_mod
from notebook_accel.launch.output import LineSplitter, OutputHistory, OutputLine
from notebook_accel.launchers import notebook_launcher
from tests.launcher_helpers import Collect

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_launch_leaks")]


# ---------------------------------------------------------------------------------------- long lines


def _splitter() -> tuple[LineSplitter, list[str]]:
    got: list[str] = []
    return LineSplitter(0, "stdout", lambda line: got.append(line.text)), got


def test_long_line_in_many_small_chunks_arrives_whole():
    # 2 MB of text with multi-byte characters, a \r\n and a \r redraw, fed in reads of 1 to 4096
    # bytes: every cut of a UTF-8 sequence and of the \r\n falls between two reads somewhere.
    unit = "abc-é-€-𝄞-"
    long_line = unit * (2_000_000 // len(unit.encode()))
    data = (long_line + "\r\n" + "bar 10%\rbar 100%\n" + long_line + "xyz").encode()
    splitter, got = _splitter()
    sizes, pos = [1, 2, 3, 7, 64, 4093, 4096], 0
    for i in range(len(data)):
        if pos >= len(data):
            break
        size = sizes[i % len(sizes)]
        splitter.feed(data[pos : pos + size])
        pos += size
    assert got == [long_line, "bar 10%", "bar 100%"]
    splitter.close()
    assert got == [long_line, "bar 10%", "bar 100%", long_line + "xyz"]


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"a\r", b"\nb\n"], ["a", "b"]),  # \r\n split over two reads: one line end
        ([b"a\r", b"\r", b"\n"], ["a", ""]),  # \r then \r\n: a line, then an empty one
        ([b"x" * 10, b"\r"], ["x" * 10]),  # a final \r is held, then ends the line at close
        ([b"\xe2\x82", b"\xac\n"], ["\u20ac"]),  # a UTF-8 character cut between reads
        ([b"a\n\n", b"\n"], ["a", "", ""]),  # empty lines are lines
        ([b"\xff\n"], ["\ufffd"]),  # invalid bytes become the replacement character
    ],
)
def test_line_ends_across_reads(chunks, expected):
    splitter, got = _splitter()
    for chunk in chunks:
        splitter.feed(chunk)
    splitter.close()
    assert got == expected


def _print_long_line(size: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        sys.stdout.write("x" * (size - 1) + "y\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return size


def test_long_line_through_the_launcher_arrives_whole():
    size = 12 << 20
    sink = Collect()
    assert (
        notebook_launcher(_print_long_line, (size,), num_processes=2, sinks=[sink], timeout=60) == [size] * 2
    )
    (line,) = sink.texts(1, "stdout")
    assert len(line) == size and line.endswith("xy") and line.count("x") == size - 1


# ------------------------------------------------------------------------------- signals during output


def _print_one_huge_line(size: int) -> int:
    text = "".join(chr(ord("a") + i % 26) for i in range(26)) * (size // 26)
    print(text, flush=True)
    return len(text)


def _print_many_lines(count: int, size: int) -> int:
    for i in range(count):
        print(f"{i:06d}" + "z" * (size - 6), flush=True)
    return count


def _stacks_while_running(handle, every: float) -> int:
    taken = 0
    while not handle.done:
        handle.stacks()
        taken += 1
        time.sleep(every)
    return taken


def test_one_huge_line_survives_stacks_signals():
    size = 20 << 20
    sink = Collect()
    handle = notebook_launcher(_print_one_huge_line, (size,), num_processes=1, sinks=[sink], block=False)
    taken = _stacks_while_running(handle, 0.0)
    [written] = handle.result()
    assert taken >= 1  # stacks() was asked while the rank wrote
    (line,) = sink.texts(0, "stdout")
    assert len(line) == written
    assert line == "abcdefghijklmnopqrstuvwxyz" * (size // 26)


def test_many_long_lines_survive_stacks_every_fifth_of_a_second():
    count, size = 150, 1 << 20
    sink = Collect()
    handle = notebook_launcher(_print_many_lines, (count, size), num_processes=1, sinks=[sink], block=False)
    _stacks_while_running(handle, 0.2)
    assert handle.result() == [count]
    lines = sink.texts(0, "stdout")
    assert [len(t) for t in lines] == [size] * count
    assert [t[:6] for t in lines] == [f"{i:06d}" for i in range(count)]


# ------------------------------------------------------------------------------------ bounded history


def _line(rank: int, text: str) -> OutputLine:
    return OutputLine(rank, "stdout", text, 0.0)


def test_history_keeps_the_newest_lines_within_its_byte_bound():
    history = OutputHistory(max_lines=1000, max_bytes=10_000)
    for i in range(100):
        history.append(_line(i % 2, f"{i:03d}" + "x" * 997))
    kept = history.snapshot()
    assert history.bytes <= 10_000 and len(kept) == 9
    assert [ln.text[:3] for ln in kept] == [f"{i:03d}" for i in range(91, 100)]
    assert history.dropped_lines == 91 and history.dropped_bytes == sum(
        sys.getsizeof("x" * 1000) for _ in range(91)
    )
    assert [ln.text[:3] for ln in history.snapshot(rank=1)] == ["091", "093", "095", "097", "099"]
    assert "91 older output line(s) dropped (" in history.dropped_text()


def test_history_keeps_the_newest_line_even_over_the_bound_and_counts_lines_too():
    history = OutputHistory(max_lines=3, max_bytes=100)
    history.append(_line(0, "small"))
    history.append(_line(0, "y" * 1000))
    assert [ln.text[:1] for ln in history.snapshot()] == ["y"] and history.dropped_lines == 1
    lines = OutputHistory(max_lines=3, max_bytes=1 << 20)
    for i in range(5):
        lines.append(_line(0, str(i)))
    assert [ln.text for ln in lines.snapshot()] == ["2", "3", "4"] and lines.dropped_lines == 2
    assert OutputHistory().dropped_text() == ""


def test_handle_history_is_bounded_in_bytes(monkeypatch):
    monkeypatch.setattr(output_mod, "HISTORY_BYTES", 8 << 20)
    count, size = 40, 1 << 20
    handle = notebook_launcher(_print_many_lines, (count, size), num_processes=1, sinks=[], block=False)
    assert handle.result() == [count]
    assert handle.history_bytes <= (8 << 20)
    kept = [ln.text for ln in handle.lines() if ln.text.startswith("0")]
    assert 0 < len(kept) <= 8 and kept[-1].startswith(f"{count - 1:06d}")
    assert handle.dropped_lines >= count - 8 and handle.dropped_bytes >= (count - 8) * size
    seen: list[OutputLine] = []
    handle.subscribe(seen.append)()  # a late subscriber gets what is kept
    assert len(seen) == len(handle.lines())
    from notebook_accel.widgets import LaunchPanel

    panel = LaunchPanel(handle)  # the panel says that older lines are gone
    assert f"{handle.dropped_lines} older output line(s) dropped" in repr(panel)
    assert "older output line(s) dropped" in panel._repr_html_()
    panel.close()


def test_restarting_handle_history_is_bounded_in_bytes(monkeypatch):
    monkeypatch.setattr(output_mod, "HISTORY_BYTES", 4 << 20)
    handle = notebook_launcher(
        _print_many_lines, (12, 1 << 20), num_processes=1, sinks=[], block=False, max_restarts=1
    )
    assert handle.result() == [12]
    assert handle.history_bytes <= (4 << 20) and handle.dropped_lines >= 8


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_finished_launch_once_dropped_is_freed_at_once(restarts):
    # Its output history (up to HISTORY_BYTES) went with the handle only at the next full collection
    # while the line splitters and the hang watch held the handle in reference cycles.
    gc.collect()
    gc.disable()
    try:
        handle = notebook_launcher(
            _print_many_lines, (20, 1000), num_processes=2, sinks=[], block=False, max_restarts=restarts
        )
        assert handle.result() == [20, 20]
        gone = weakref.ref(handle)
        del handle
        deadline = time.monotonic() + 10  # the supervising thread lets go of it as it ends
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone() is None, [type(r).__qualname__ for r in gc.get_referrers(gone())]
    finally:
        gc.enable()


# ------------------------------------------------------------------------ refused before any fork


async def _async_train(x):
    return x


def _generator_train(x):
    yield x


async def _async_generator_train(x):
    yield x


@pytest.mark.parametrize(
    ("function", "match"),
    [
        (_async_train, r"_async_train is an async def function.*asyncio\.run\(_async_train\(\*args\)\)"),
        (_generator_train, r"_generator_train is a generator function.*list\(_generator_train\(\*args\)\)"),
        (_async_generator_train, r"_async_generator_train is an async generator function.*async for"),
    ],
)
def test_coroutine_and_generator_functions_are_refused_before_forking(monkeypatch, function, match):
    from notebook_accel.launch import procs

    def no_fork(*_args):
        raise AssertionError("forked")

    monkeypatch.setattr(procs, "start_worker", no_fork)
    with pytest.raises(TypeError, match=match):
        notebook_launcher(function, (1,), num_processes=2)


def test_far_more_processes_than_cores_needs_the_opt_in(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(
        ValueError, match=r"num_processes=129 is more than 64 .* \(2 core\(s\)\).*allow_oversubscribe=True"
    ):
        notebook_launcher(_print_many_lines, (0, 1), num_processes=129)
    with pytest.raises(TypeError, match=r"allow_oversubscribe='yes' must be True or False"):
        notebook_launcher(_print_many_lines, (0, 1), num_processes=2, allow_oversubscribe="yes")
    from notebook_accel.launch.request import LaunchRequest

    # 128 is still allowed, and so is more with the opt-in (checked only: nothing is started)
    assert LaunchRequest(function=_print_many_lines, args=(0, 1), num_processes=128).num_processes == 128
    request = LaunchRequest(
        function=_print_many_lines, args=(0, 1), num_processes=129, allow_oversubscribe=True
    )
    assert request.num_processes == 129


# ------------------------------------------------------------------------------------- failed forks


def test_a_failed_fork_names_the_rank_and_stops_the_ones_started(monkeypatch):
    from notebook_accel.launch import procs

    real_fork, forked = os.fork, []

    def fork_once() -> int:
        if forked:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        pid = real_fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(procs.os, "fork", fork_once)
    with pytest.raises(
        BlockingIOError, match=r"could not start rank 1 of 2 \(fork: .*\).*ulimit -u"
    ) as caught:
        notebook_launcher(_print_many_lines, (1, 10), num_processes=2, sinks=[])
    assert caught.value.errno == 11
    monkeypatch.undo()
    [pid] = forked
    with pytest.raises(ChildProcessError):  # rank 0 was started, then killed and reaped
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_failed_spawn_for_lack_of_memory_names_the_rank(monkeypatch):
    import subprocess

    def no_memory(*_args, **_kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(subprocess, "Popen", no_memory)
    with pytest.raises(
        OSError, match=r"could not start rank 0 of 2 \(spawn: Cannot allocate memory\).*free memory"
    ):
        notebook_launcher(_print_many_lines, (1, 10), num_processes=2, sinks=[], start_method="spawn")
