"""Interactive ranks from a plain process: a real 2-rank gloo group forked from pytest, kept between calls.

One group serves the module (``ranks`` fixture); the tests that break it (a death, a hang) end by
restarting it, which is part of what they check. The leak test stops it and counts what is left.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections import Counter

import pytest

import notebook_accel
from notebook_accel.interactive import CellResult, NoRanksError, RankError, Ranks, current, start_ranks
from notebook_accel.launch.request import DEFAULT_HANG_TIMEOUT
from tests.launcher_helpers import Snapshot, fd_count, live_children, printed_by, printed_lines

pytestmark = pytest.mark.timeout(120)

KERNEL_CONSTANT = 1234  # set on __main__ before the fork: the ranks see it there


@pytest.fixture(scope="module")
def _group():
    main = sys.modules["__main__"]
    main.KERNEL_CONSTANT = KERNEL_CONSTANT
    main.kernel_helper = lambda x: x * 10
    main.fork_lock = threading.Lock()
    ranks = start_ranks(2, hang_timeout=60)
    yield ranks
    ranks.stop()
    for name in ("KERNEL_CONSTANT", "kernel_helper", "fork_lock"):
        delattr(main, name)


@pytest.fixture
def ranks(_group: Ranks) -> Ranks:
    if not _group.alive:  # a test before stopped or broke it
        _group.restart()
    assert current() is _group
    return _group


def test_code_returns_last_expression_per_rank_and_namespaces_persist(ranks: Ranks) -> None:
    assert ranks.num_processes == 2
    assert ranks.run("rank, world_size") == [(0, 2), (1, 2)]
    assert ranks.run("x = rank * 100") == [None, None]
    assert ranks.run("x + 1") == [1, 101]
    assert ranks.run("x", on=1) == [100]
    # what the calling process had before the fork: its __main__ names
    assert ranks.run("KERNEL_CONSTANT + rank, kernel_helper(rank)") == [(1234, 0), (1235, 10)]


def test_all_reduce_uses_the_group_and_output_is_printed_with_rank_labels(ranks: Ranks, capsys) -> None:
    code = "import torch, torch.distributed as dist\nt = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\nprint('sum', t.tolist())\nt.sum().item()"
    assert ranks.run(code) == [9.0, 9.0]
    out = capsys.readouterr().out  # printed by the calling thread before run() returned
    assert printed_by(out, "sum [3.0, 3.0, 3.0]") in ([0, 1], [1, 0])  # once as [ranks 0,1], or apart
    # More than a pipe holds: every line is printed before run() returns, the last one included.
    ranks.run("for i in range(4000):\n    print('line', i, 'x' * 60)")
    out = capsys.readouterr().out
    copies = Counter(r for shown, text in printed_lines(out) if text.startswith("line ") for r in shown)
    assert copies == {0: 4000, 1: 4000}
    assert printed_by(out, f"line 3999 {'x' * 60}") in ([0, 1], [1, 0])
    assert ranks.run(
        "from notebook_accel import PartialState\ns = PartialState()\n(s.num_processes, s.process_index)"
    ) == [
        (2, 0),
        (2, 1),
    ]


class _TimedStream:
    """A stream recording when each piece of text was written."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.writes.append((time.monotonic(), text))
        return len(text)

    def flush(self) -> None:
        pass


def test_output_is_printed_live_by_the_calling_thread(ranks: Ranks, monkeypatch) -> None:
    stream = _TimedStream()
    monkeypatch.setattr(sys, "stdout", stream)
    ranks.run("import time\nprint('early', flush=True)\ntime.sleep(1.5)\nprint('late')")
    ended = time.monotonic()
    monkeypatch.undo()
    early = [t for t, text in stream.writes if 0 in printed_by(text, "early")]
    late = [t for t, text in stream.writes if 0 in printed_by(text, "late")]
    assert early and late
    assert ended - early[0] > 1.0  # shown while the command still ran, not at its end


def test_functions_run_in_the_rank_namespace(ranks: Ranks) -> None:
    ranks.run("scale = 3 + rank")
    offset = 7  # noqa: F841  (a kernel local: a closure brings it along)

    def scaled(value, *, plus=0):
        return value * scale + plus + rank  # noqa: F821  (names of the rank's namespace)

    def with_offset():
        return offset + rank  # noqa: F821

    # As a function defined in a notebook cell: the kernel's __main__ (pickled by value).
    scaled.__module__ = with_offset.__module__ = "__main__"
    assert ranks.run(scaled, 2, plus=1) == [7, 10]
    assert ranks.run(with_offset) == [7, 8]
    assert ranks.run(len, [1, 2, 3]) == [3, 3]  # anything else is called as it is


def test_cell_functions_use_what_the_ranks_got_at_the_fork_without_pickling_it(ranks: Ranks) -> None:
    main = sys.modules["__main__"]
    # Defined as a notebook cell defines them: in __main__, after the ranks were started.
    exec(
        "after_fork = 5\n"
        "def helper():\n    return after_fork + rank\n"
        "def uses_fork_lock():\n    return type(fork_lock).__name__, kernel_helper(1), helper()\n",
        vars(main),
    )
    try:
        # fork_lock (from before the fork) cannot be pickled: it stays behind, each rank uses its own
        assert ranks.run(main.uses_fork_lock) == [("lock", 10, 5), ("lock", 10, 6)]
    finally:
        for name in ("after_fork", "helper", "uses_fork_lock"):
            delattr(main, name)


def test_execute_gives_text_and_html(ranks: Ranks) -> None:
    code = (
        "class Shown:\n"
        "    def __repr__(self): return f'Shown({rank})'\n"
        "    def _repr_html_(self): return f'<b>{rank}</b>'\n"
        "Shown()"
    )
    results = ranks.execute(code)
    assert [(r.rank, r.text, r.html, r.ok) for r in results] == [
        (0, "Shown(0)", "<b>0</b>", True),
        (1, "Shown(1)", "<b>1</b>", True),
    ]
    assert [r.text for r in ranks.execute("y = 1")] == [None, None]
    assert [r.text for r in ranks.execute("None")] == [None, None]
    assert isinstance(results[0], CellResult)


def test_syntax_error_is_refused_before_any_rank_runs(ranks: Ranks) -> None:
    ranks.run("runs = 0")
    with pytest.raises(SyntaxError):
        ranks.run("runs += 1\nif")
    assert ranks.run("runs") == [0, 0]


def test_exception_on_one_rank_raises_its_traceback_and_keeps_the_namespaces(ranks: Ranks) -> None:
    ranks.run("kept = rank + 10")
    with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) ZeroDivisionError") as info:
        ranks.run("def divide():\n    return 1 / (1 - rank)\ndivide()")
    error = info.value
    assert not error.broken
    text = str(error)
    assert text.startswith("rank 1 (pid")  # the failing rank first, then its own traceback
    assert text.index("Traceback of rank 1") < text.rindex("ZeroDivisionError: division by zero")
    assert "return 1 / (1 - rank)" in text  # the cell's source line, through linecache on the rank
    assert [r.ok for r in error.results] == [True, False]
    assert [s.state for s in ranks.status()] == ["idle", "failed"]
    assert ranks.alive and not ranks.broken
    assert ranks.run("kept") == [10, 11]
    assert [s.state for s in ranks.status()] == ["idle", "idle"]


def test_code_raising_keyboard_interrupt_itself_is_a_failure_of_that_rank(ranks: Ranks) -> None:
    # The rank replies Interrupted (no Stop was pressed): its traceback, the ranks alive.
    with pytest.raises(RankError, match=r"rank 0 \(pid \d+\) KeyboardInterrupt") as info:
        ranks.run("if rank == 0:\n    raise KeyboardInterrupt")
    assert not info.value.broken and [r.ok for r in info.value.results] == [False, True]
    assert "raise KeyboardInterrupt" in str(info.value)
    assert ranks.run("rank") == [0, 1]


def test_a_rank_breaking_the_protocol_breaks_the_group_with_a_clear_error(ranks: Ranks) -> None:
    # Rank 1 writes a frame of no known kind on its socket to the kernel before its reply.
    code = (
        "import gc, pickle, struct\n"
        "from notebook_accel.interactive.rank_loop import RankLoop\n"
        "loop = next(o for o in gc.get_objects() if isinstance(o, RankLoop))\n"
        "body = pickle.dumps(('bogus', 1))\n"
        "loop.sock.sendall(struct.pack('>I', len(body)) + body)"
    )
    with pytest.raises(
        RankError,
        match=r"rank 1 sent what the kernel<->rank protocol does not allow \(unknown message type 'bogus'",
    ) as info:
        ranks.run(code, on=1)
    assert info.value.broken and not ranks.alive


def test_push_and_pull(ranks: Ranks) -> None:
    ranks.push("lr", 0.5)
    ranks.push_many(alpha=1, beta=[2, 3])
    ranks.push("only_one", "yes", on=[1])
    assert ranks.run("lr * (rank + 1), alpha, beta") == [(0.5, 1, [2, 3]), (1.0, 1, [2, 3])]
    assert ranks.pull("only_one", on=1) == ["yes"]
    ranks.run("import torch\nw = torch.full((2,), float(rank))")
    pulled = ranks.pull("w")
    assert [p.tolist() for p in pulled] == [[0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(RankError, match="name 'missing' is not defined on rank 0"):
        ranks.pull("missing")


def test_values_that_cannot_be_pickled_are_refused_with_their_type(ranks: Ranks) -> None:
    ranks.run("sent = 'before'")
    with pytest.raises(TypeError, match=r"sent \(a builtins.generator\) cannot be pickled.*push plain data"):
        ranks.push("sent", (i for i in range(3)))
    assert ranks.run("sent") == ["before", "before"]  # nothing changed on the ranks
    ranks.run("import threading\nlock = threading.Lock()")
    with pytest.raises(TypeError, match=r"lock on rank 0 is a _thread.lock.*pull a picklable part"):
        ranks.pull("lock")
    with pytest.raises(TypeError, match=r"rank 0 computed \(a _thread.lock.*cannot be pickled back"):
        ranks.run("lock")
    with pytest.raises(ValueError, match="'not a name' is not a Python name"):
        ranks.push("not a name", 1)


@pytest.mark.parametrize(
    ("on", "message"),
    [
        ([5], r"on=\[5\]: rank 5 does not exist; this group has ranks 0..1"),
        ([], "names no rank"),
        (-1, "rank -1 does not exist"),
    ],
)
def test_bad_targets_are_refused(ranks: Ranks, on, message) -> None:
    with pytest.raises(ValueError, match=message):
        ranks.run("1", on=on)
    assert ranks.run("2") == [2, 2]


def test_a_second_start_and_bad_options_are_refused_without_side_effects(ranks: Ranks) -> None:
    pids = [s.pid for s in ranks.status()]
    with pytest.raises(RuntimeError, match=r"already running.*ranks.stop\(\) \(or %ranks stop\)"):
        start_ranks(2)
    with pytest.raises(ValueError, match="num_processes=0 must be a positive integer"):
        Ranks(0)
    with pytest.raises(ValueError, match="hang_timeout=-1 must be a positive number"):
        Ranks(2, hang_timeout=-1)
    with pytest.raises(ValueError, match=r"collapse_output=-1 must be a positive, finite number of seconds"):
        Ranks(2, collapse_output=-1)
    with pytest.raises(ValueError, match="start_method='thread' is not supported"):
        Ranks(2, start_method="thread")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['max_restarts'\]"):
        start_ranks(2, max_restarts=1)
    with pytest.raises(TypeError, match="takes a string of code or a callable"):
        ranks.run(42)
    assert [s.pid for s in ranks.status()] == pids and current() is ranks


def test_stacks_between_commands_show_idle_ranks(ranks: Ranks) -> None:
    stacks = ranks.stacks()
    assert sorted(stacks) == [0, 1]
    assert all(s.answered and s.summary() == "idle, waiting for a command" for s in stacks.values())
    assert all("rank_loop.py" in s.text for s in stacks.values())


def test_commands_after_stop_say_how_to_start(ranks: Ranks) -> None:
    ranks.stop()
    ranks.stop()  # idempotent
    assert not ranks.alive and current() is None
    with pytest.raises(NoRanksError, match=r"start_ranks\(\.\.\.\)"):
        ranks.run("1")
    with pytest.raises(NoRanksError, match=r"start_ranks\(2\) \(or %ranks start 2\)"):
        notebook_accel.interactive.require_current()


def test_a_start_that_fails_leaves_nothing_running() -> None:
    import socket

    current_ranks = current()
    if current_ranks is not None:
        current_ranks.stop()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    before = fd_count()
    try:
        with pytest.raises(RuntimeError, match=str(taken.getsockname()[1])):
            start_ranks(2, use_port=taken.getsockname()[1])
    finally:
        taken.close()
    assert current() is None and live_children() == [] and fd_count() <= before - 1


def _interrupt_main_thread_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_keyboard_interrupt_stops_the_command_on_every_rank_and_keeps_the_namespaces(ranks: Ranks) -> None:
    ranks.run("import time\nkept = 'here'")
    _interrupt_main_thread_after(1.0)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match=r"interrupted rank\(s\) \[0, 1\].*namespaces intact"):
        ranks.run("print('sleeping', flush=True)\ntime.sleep(60)")
    assert time.monotonic() - started < 6
    assert ranks.alive
    assert ranks.run("kept") == ["here", "here"]
    # A SIGINT reaching an idle rank does not end its loop.
    for pid in ranks.handle.pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.3)
    assert ranks.run("kept + str(rank)") == ["here0", "here1"]


def test_a_rank_raising_while_the_other_waits_in_all_reduce_breaks_the_group_without_hanging(
    ranks: Ranks,
) -> None:
    code = (
        "import torch, torch.distributed as dist\n"
        "def step():\n"
        "    if rank == 1:\n"
        "        raise ValueError('bad batch on rank 1')\n"
        "    t = torch.ones(1)\n"
        "    dist.all_reduce(t)\n"
        "step()"
    )
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(code)
    assert time.monotonic() - started < ranks_hang_timeout(ranks) + 5
    error = info.value
    text = str(error)
    assert error.broken and ranks.broken and not ranks.alive
    assert text.startswith("rank 1 (pid")
    assert "ValueError: bad batch on rank 1" in text
    assert "rank 0 in all_reduce" in text and "gloo cannot abort a collective" in text
    assert "Stacks of rank 0" in text and "Stacks of rank 1" in text  # every rank's stack
    assert "rank 1: idle, waiting for a command" in text
    with pytest.raises(RuntimeError, match=r"broken.*ranks.restart\(\)"):
        ranks.run("1")
    assert ranks.restart() == [0, 1]
    assert ranks.run("rank") == [0, 1] and not ranks.broken


def ranks_hang_timeout(ranks: Ranks) -> float:
    return ranks._options["hang_timeout"]


def test_ranks_busy_in_collectives_among_themselves_are_not_taken_for_stuck() -> None:
    current_ranks = current()
    if current_ranks is not None:
        current_ranks.stop()
    code = (
        "import time, torch, torch.distributed as dist\n"
        "pair = dist.new_group([0, 1])\n"
        "if rank == 2:\n"
        "    raise ValueError('rank 2 fails alone')\n"
        "end, going = time.monotonic() + 3, torch.ones(1)\n"
        "while going.item():  # the pair agrees on when to stop\n"
        "    going = torch.tensor([float(time.monotonic() < end)])\n"
        "    dist.all_reduce(going, op=dist.ReduceOp.MIN, group=pair)\n"
    )
    with start_ranks(3) as ranks:
        with pytest.raises(RankError, match="rank 2 fails alone") as info:
            ranks.run(code)
        assert not info.value.broken and ranks.alive  # barriers that complete move bytes: not a wait
        assert ranks.run("rank") == [0, 1, 2]


def test_a_collective_that_only_some_ranks_entered_breaks_the_group(ranks: Ranks) -> None:
    started = time.monotonic()
    with pytest.raises(
        RankError, match=r"rank 0 in barrier waits for rank\(s\) \[1\], which do not run"
    ) as info:
        ranks.run("import torch, torch.distributed as dist\ndist.barrier()", on=[0])
    assert time.monotonic() - started < ranks_hang_timeout(ranks)
    assert info.value.broken and "Stacks of rank 0" in str(info.value)
    ranks.restart()
    code = (
        "import time, torch.distributed as dist\nif rank == 1:\n    time.sleep(1)\nelse:\n    dist.barrier()"
    )
    with pytest.raises(RankError, match=r"rank 0 in barrier waits for rank\(s\) \[1\], which finished"):
        ranks.run(code)
    assert ranks.restart() == [0, 1]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import os\nprint('last words', flush=True)\nos._exit(3)", "exited with code 3"),
        ("import ctypes\nprint('last words', flush=True)\nctypes.string_at(0)", "SIGSEGV"),
    ],
)
def test_a_rank_that_dies_is_reported_with_its_last_output(ranks: Ranks, code: str, expected: str) -> None:
    with pytest.raises(RankError, match=expected) as info:
        ranks.run("if rank == 1:\n" + "".join(f"    {line}\n" for line in code.splitlines()), on=None)
    error = info.value
    assert error.broken and ranks.broken
    assert error.failures[0].rank == 1
    assert "last words" in str(error)
    assert [s.state for s in ranks.status()] == ["dead", "dead"]
    ranks.restart()
    # a rank dying between commands: the next command says so
    os.kill(ranks.handle.pids[0], signal.SIGKILL)
    assert ranks.handle.wait(10)
    with pytest.raises(
        RuntimeError, match=r"broken \(rank 0 \(pid \d+\) Signal: killed by SIGKILL.*restart\(\)"
    ):
        ranks.run("rank")
    ranks.restart()
    assert ranks.run("rank") == [0, 1]


def test_twenty_start_stop_cycles_leave_nothing_behind(_group: Ranks) -> None:
    _group.stop()
    with start_ranks(2) as ranks:  # the first start creates what lives as long as the process
        ranks.run("1")
    snap = Snapshot()
    threads = {t.ident for t in threading.enumerate()}
    for _ in range(20):
        ranks = start_ranks(2)
        assert ranks.run("rank") == [0, 1]
        ranks.stop()
    assert live_children() == []
    assert fd_count() <= snap.fds
    assert {t.ident for t in threading.enumerate()} <= threads
    snap.assert_clean()


@pytest.mark.parametrize(
    ("hang_timeout", "expected"), [(math.inf, math.inf), (None, DEFAULT_HANG_TIMEOUT), (0.5, 0.5)]
)
def test_hang_timeout_may_be_infinite_or_the_default(hang_timeout, expected) -> None:
    running = current()
    if running is not None:
        running.stop()
    with start_ranks(2, hang_timeout=hang_timeout) as ranks:
        # The command's watch judges waits with this timeout (tests/test_interactive_hangs.py: what it does).
        assert ranks.handle.hang_timeout == expected and ranks._group.hang_timeout == expected
        assert ranks.run("rank") == [0, 1]
