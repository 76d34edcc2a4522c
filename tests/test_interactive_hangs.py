"""When the interactive ranks' watch gives a command up, and when it keeps waiting: real 2-rank gloo groups.

The rule (``notebook_accel/interactive/watch.py``, the guide's "When a command hangs"): a busy rank
is honest work, reported once; the group is given up when every rank waits and none moved for
``hang_timeout`` (a deadlock), or at once when the busy ranks wait for an idle one.
"""

from __future__ import annotations

import threading
import time

import pytest

from notebook_accel.interactive import RankError, Ranks, current, start_ranks

pytestmark = pytest.mark.timeout(180)

HANG_TIMEOUT = 3
# Given up no sooner than hang_timeout, and not much later: the first sample waits a second of silence,
# then one a second; the rest is a loaded 2-core machine (the suite runs beside other work).
LATE = 12


@pytest.fixture(scope="module")
def _group():
    running = current()
    if running is not None:
        running.stop()
    ranks = start_ranks(2, hang_timeout=HANG_TIMEOUT)
    yield ranks
    ranks.stop()


@pytest.fixture
def ranks(_group: Ranks) -> Ranks:
    if not _group.alive:
        _group.restart()
    return _group


def test_honest_work_of_one_rank_is_reported_once_and_the_command_goes_on(ranks: Ranks, capsys) -> None:
    ranks.run("kept = f'before {rank}'")
    code = (
        "import time\n"
        "from notebook_accel import PartialState\n"
        "with PartialState().main_process_first():\n"
        "    if rank == 0:\n"
        f"        time.sleep({2 * HANG_TIMEOUT + 2})  # a dataset.map, a checkpoint written by rank 0\n"
        "    done = f'done {rank}'\n"
        "rank"
    )
    capsys.readouterr()
    assert ranks.run(code) == [0, 1]  # rank 1 waited in a barrier for more than hang_timeout: no hang
    out = capsys.readouterr().out
    assert out.count("a busy rank is not a hang") == 1, out  # reported once, not every sample
    assert "rank 1 in barrier" in out and "while rank(s) [0] are busy" in out
    assert "Stacks of rank 0" in out and "time.sleep(" in out  # where the busy one is, its stack
    assert ranks.alive and ranks.run("kept, done") == [("before 0", "done 0"), ("before 1", "done 1")]


def test_ranks_receiving_from_each_other_are_given_up_after_hang_timeout_with_every_stack(
    ranks: Ranks,
) -> None:
    code = "import torch, torch.distributed as dist\nt = torch.zeros(1)\ndist.recv(t, src=1 - rank)"
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks.run(code)
    took = time.monotonic() - started
    assert HANG_TIMEOUT <= took < HANG_TIMEOUT + LATE, took
    text = str(info.value)
    assert info.value.broken and ranks.broken
    assert f"deadlock: no rank has made progress for hang_timeout={HANG_TIMEOUT} s" in text
    assert "rank 0 in recv, rank 1 in recv" in text
    assert "Stacks of rank 0" in text and "Stacks of rank 1" in text
    assert ranks.restart() == [0, 1] and ranks.run("rank") == [0, 1]


def test_collectives_called_in_different_orders_are_given_up_after_hang_timeout(ranks: Ranks) -> None:
    code = (
        "import torch.distributed as dist\n"
        "a, b = dist.new_group([0, 1]), dist.new_group([0, 1])\n"
        "first, second = (a, b) if rank == 0 else (b, a)\n"
        "dist.barrier(group=first)\n"
        "dist.barrier(group=second)"
    )
    started = time.monotonic()
    with pytest.raises(RankError, match=r"deadlock: .*rank 0 in barrier, rank 1 in barrier") as info:
        ranks.run(code)
    took = time.monotonic() - started
    assert HANG_TIMEOUT <= took < HANG_TIMEOUT + LATE, took
    assert "Stacks of rank 0" in str(info.value) and "Stacks of rank 1" in str(info.value)


def test_a_hang_event_between_commands_does_not_stop_the_next_one(ranks: Ranks) -> None:
    ranks.run("1")
    # What the launcher's watch sends when it suspects a hang, landing after the command ended.
    ranks.handle._events.notify("hang", -1, "suspected hang: a report from an earlier command")
    assert ranks.run("rank") == [0, 1] and ranks.alive


def test_stacks_of_a_silent_subset_command_are_sampled_beside_the_command_loop(ranks: Ranks) -> None:
    group = ranks._group
    calls, release = [], threading.Event()

    def slow_stacks() -> dict:
        calls.append(time.monotonic())
        release.wait(60)  # a rank that does not answer: the sample takes long
        return {}

    group._take_stacks = slow_stacks
    timer = threading.Timer(30, release.set)
    timer.start()
    try:
        assert ranks.run("import time\ntime.sleep(3)\nrank", on=[0]) == [0]
        assert calls, "no sample was taken of a silent rank"
        assert not release.is_set(), "the command waited for the stack sample"
    finally:
        release.set()
        timer.cancel()
        del group._take_stacks


def test_a_subset_command_that_prints_is_not_sampled(ranks: Ranks) -> None:
    group = ranks._group
    calls: list[float] = []
    taken = group._take_stacks

    def counted() -> dict:
        calls.append(time.monotonic())
        return taken()

    group._take_stacks = counted
    try:
        code = "import time\nfor i in range(30):\n    print(i, flush=True)\n    time.sleep(0.1)\nrank"
        assert ranks.run(code, on=[0]) == [0]
    finally:
        del group._take_stacks
    assert calls == []


class _ClaimThenInterrupt(dict):
    """A Stop landing just after the command claimed the ranks, before anything else."""

    def setdefault(self, key, default=None):  # noqa: ANN001, ANN201
        super().setdefault(key, default)
        raise KeyboardInterrupt


def test_a_stop_right_after_a_command_claimed_the_ranks_does_not_block_the_next(ranks: Ranks) -> None:
    commands = ranks._commands
    real = commands._claims
    commands._claims = _ClaimThenInterrupt()
    try:
        with pytest.raises(KeyboardInterrupt):
            ranks.run("1")
    finally:
        left, commands._claims = dict(commands._claims), real
    assert left == {}  # released
    commands._claims.update(left)
    assert ranks.run("rank") == [0, 1]


def test_another_threads_command_is_refused_while_one_runs(ranks: Ranks) -> None:
    errors: list[BaseException] = []
    started = threading.Event()

    def other() -> None:
        started.wait(10)
        time.sleep(0.5)
        try:
            ranks.run("1")
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    started.set()
    ranks.run("import time\ntime.sleep(2)")
    thread.join(30)
    assert len(errors) == 1 and "another command is running" in str(errors[0])
    assert ranks.run("rank") == [0, 1]  # the refused one released nothing it did not hold
