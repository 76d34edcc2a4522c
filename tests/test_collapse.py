"""Identical lines of several ranks shown once with their rank set (``launch.collapse``), on a fake clock.

Every rule of the module docstring has a test here: complete sets go out at once, partial ones after the
window, a rank's own lines without delay once learnt, per-rank order, first-arrival order, the flush, the
labels (node-aware, attempts, templates), the option's validation and the off switch; a seeded
property test feeds random interleavings of many ranks and checks that every line comes out once.
"""

from __future__ import annotations

import bisect
import io
import random
from collections import Counter

import pytest

from notebook_accel.interactive.cell_output import CellSink
from notebook_accel.launch.collapse import (
    DEFAULT_WINDOW,
    LONGEST,
    SOLO_AFTER,
    Collapser,
    CollapsingPrinter,
    collapse_window,
)
from notebook_accel.launch.output import OutputLine, PrintSink, node_span, rank_span, span_text
from notebook_accel.launch.plan import resolve_plan
from notebook_accel.launch.request import LaunchRequest
from notebook_accel.launch.runner import build_sinks as _build_sinks
from tests.launcher_helpers import printed_by, wait_until

W = 0.25


def _line(rank: int, text: str, stream: str = "stdout", attempt: int = 1) -> OutputLine:
    return OutputLine(rank, stream, text, 0.0, attempt)


class Cell:
    """A collapser on a fake clock printing through a real PrintSink into one text buffer."""

    def __init__(self, ranks=range(4), window: float = W, **sink) -> None:
        self.out = io.StringIO()
        self.printer = PrintSink(stdout=self.out, stderr=self.out, num_processes=len(ranks), **sink)
        self.emitted: list[tuple[OutputLine, tuple[int, ...], float]] = []
        self.now = 0.0
        self.c = Collapser(ranks, window, self._emit)

    def _emit(self, line: OutputLine, ranks: tuple[int, ...]) -> None:
        self.emitted.append((line, ranks, self.now))
        self.printer.write(line, ranks)

    def feed(self, rank: int, text: str, at: float | None = None, **kw) -> None:
        if at is not None:
            self.now = at
        self.c.feed(_line(rank, text, **kw), self.now)

    def at(self, now: float) -> None:
        self.now = now
        self.c.expire(now)

    @property
    def shown(self) -> list[str]:
        return self.out.getvalue().splitlines()


def test_a_line_every_rank_prints_goes_out_once_as_soon_as_the_last_rank_printed_it() -> None:
    cell = Cell()
    for rank in range(3):
        cell.feed(rank, "loss 0.25", at=0.01 * rank)
    assert cell.shown == []  # rank 3 may still print it
    cell.feed(3, "loss 0.25", at=0.05)
    assert cell.shown == ["[ranks 0-3] loss 0.25"]  # the set is complete: no wait for the window
    assert cell.c.pending == 0 and cell.c.next_deadline is None


def test_a_line_some_ranks_print_goes_out_after_the_window_labelled_with_exactly_those_ranks() -> None:
    cell = Cell()
    cell.feed(0, "same", at=0.0)
    cell.feed(2, "same", at=0.1)
    cell.at(W - 0.001)
    assert cell.shown == []
    assert cell.c.next_deadline == W
    cell.at(W)
    assert cell.shown == ["[ranks 0,2] same"]
    cell.feed(1, "same", at=0.3)  # too late for that group: a new one, its own window
    cell.at(0.3 + W)
    assert cell.shown == ["[ranks 0,2] same", "[rank 1] same"]


def test_only_exact_matches_collapse_and_no_text_is_changed() -> None:
    cell = Cell(ranks=range(2))
    cell.feed(0, "loss 0.25")
    cell.feed(1, "loss 0.26")  # equal once numbers are masked: Ray would merge them, we do not
    cell.feed(0, "x", stream="stderr")
    cell.feed(1, "x")  # another stream
    cell.c.flush()
    assert sorted(cell.shown) == ["[rank 0] loss 0.25", "[rank 0] x", "[rank 1] loss 0.26", "[rank 1] x"]


def test_a_rank_s_own_lines_go_out_at_once_once_their_shape_is_known() -> None:
    cell = Cell()
    cell.feed(0, "step 1 loss 0.9", at=0.0)
    assert cell.shown == []  # a new shape: other ranks may print the same
    cell.at(W)
    assert cell.shown == ["[rank 0] step 1 loss 0.9"]
    for step in range(2, 6):
        cell.feed(0, f"step {step} loss 0.{9 - step}", at=1.0 + step)
        assert cell.shown[-1] == f"[rank 0] step {step} loss 0.{9 - step}"  # printed on arrival, no delay
    # another rank printing that shape makes it shared again: its lines are held for the others
    cell.feed(1, "step 6 loss 0.3", at=10.0)
    assert cell.shown[-1] == "[rank 0] step 5 loss 0.4"
    cell.feed(0, "step 6 loss 0.3", at=10.01)
    cell.at(10.0 + W)
    assert cell.shown[-1] == "[ranks 0,1] step 6 loss 0.3"


def test_lines_that_differ_per_rank_stop_being_held_once_learnt_and_collapse_again_when_equal() -> None:
    cell = Cell(ranks=range(2))
    t = 0.0
    for step in range(SOLO_AFTER):  # held, but each comes back from one rank only
        cell.feed(0, f"rank 0 loss {step}.0", at=t)
        cell.feed(1, f"rank 1 loss {step}.5", at=t + 0.01)
        cell.at(t + W + 0.01)
        t += 1.0
    assert len(cell.shown) == 2 * SOLO_AFTER
    cell.feed(0, "rank 0 loss 7.0", at=t)
    assert cell.shown[-1] == "[rank 0] rank 0 loss 7.0"  # printed on arrival: the shape differs per rank
    # the same text from another rank within the window: the shape's lines coincide after all
    cell.feed(1, "rank 0 loss 7.0", at=t + 0.01)
    assert len(cell.shown) == 2 * SOLO_AFTER + 1  # rank 1's copy is held for the others
    cell.at(t + 0.01 + W)
    assert cell.shown[-1] == "[rank 1] rank 0 loss 7.0"
    cell.feed(0, "rank 0 loss 8.0", at=t + 1)
    cell.feed(1, "rank 0 loss 8.0", at=t + 1.01)
    assert cell.shown[-1] == "[ranks 0,1] rank 0 loss 8.0"


def test_a_rank_s_lines_never_pass_its_held_line() -> None:
    cell = Cell()
    cell.feed(0, "epoch 1", at=0.0)
    cell.at(W)  # "epoch #" is rank 0's own from now on ...
    cell.feed(1, "shared", at=1.0)  # ... but this one is held for the others
    cell.feed(1, "epoch 2", at=1.01)  # a new rank for the shape: held
    cell.feed(0, "epoch 2", at=1.02)  # joins it
    assert cell.shown == ["[rank 0] epoch 1"]
    cell.at(1.0 + W)
    assert cell.shown == ["[rank 0] epoch 1", "[rank 1] shared"]
    cell.at(1.01 + W)
    assert cell.shown == ["[rank 0] epoch 1", "[rank 1] shared", "[ranks 0,1] epoch 2"]


def test_a_line_behind_a_held_one_waits_for_it_and_then_goes_out_in_order() -> None:
    cell = Cell()
    cell.feed(0, "own 1", at=0.0)
    cell.at(W)
    cell.feed(0, "shared", at=1.0)
    cell.feed(0, "own 2", at=1.01)  # rank 0's own shape, but behind its held line
    assert cell.shown == ["[rank 0] own 1"]
    for rank in (1, 2, 3):
        cell.feed(rank, "shared", at=1.02)
    assert cell.shown == ["[rank 0] own 1", "[ranks 0-3] shared", "[rank 0] own 2"]


def test_collapsed_lines_appear_in_the_order_their_first_copy_arrived() -> None:
    cell = Cell()
    for rank in range(4):
        cell.feed(rank, "first", at=0.01 * rank)
        cell.feed(rank, "second", at=0.01 * rank + 0.001)
    cell.feed(0, "third", at=0.1)
    cell.feed(1, "third", at=0.11)
    cell.c.flush()
    assert cell.shown == ["[ranks 0-3] first", "[ranks 0-3] second", "[ranks 0,1] third"]


def test_a_rank_repeating_a_line_gets_one_copy_per_print_and_ranks_in_opposite_order_keep_theirs() -> None:
    cell = Cell(ranks=range(2))
    for rank in (0, 1):
        cell.feed(rank, "-----")
        cell.feed(rank, "body")
        cell.feed(rank, "-----")
    assert cell.shown == ["[ranks 0,1] -----", "[ranks 0,1] body", "[ranks 0,1] -----"]
    cell = Cell(ranks=range(3))
    cell.feed(0, "A")
    cell.feed(0, "B")
    cell.feed(1, "B")
    cell.feed(1, "A")  # joining rank 0's "A" would print rank 1's "A" before its "B"
    cell.c.flush()
    assert cell.shown == ["[rank 0] A", "[ranks 0,1] B", "[rank 1] A"]
    assert printed_by(cell.out.getvalue(), "A") == [0, 1]


def test_a_rank_running_behind_with_lines_of_its_own_still_joins_the_shared_lines() -> None:
    # A new collapser knows no shape yet, so each rank's own line is held too; rank 1 prints its own
    # line after rank 0 printed the shared ones: its own line goes out, its shared ones join.
    cell = Cell(ranks=range(2))
    for rank in (0, 1):
        cell.feed(rank, f"rank {rank} loaded {100 + rank} rows")
        for text in ("a", "b", "c"):
            cell.feed(rank, text)
    assert cell.shown == ["[rank 1] rank 1 loaded 101 rows"]
    cell.at(W)
    assert cell.shown[1:] == [
        "[rank 0] rank 0 loaded 100 rows",
        "[ranks 0,1] a",
        "[ranks 0,1] b",
        "[ranks 0,1] c",
    ]


def test_flush_prints_everything_held_in_order_and_leaves_nothing() -> None:
    cell = Cell(window=60.0)
    cell.feed(0, "a")
    cell.feed(1, "a")
    cell.feed(2, "b")
    cell.feed(1, "c")
    cell.c.flush()
    assert cell.shown == ["[ranks 0,1] a", "[rank 2] b", "[rank 1] c"]
    assert cell.c.pending == 0 and cell.c.next_deadline is None
    cell.feed(3, "late")  # the collapser goes on after a flush (an interactive command's next lines)
    cell.c.flush()
    assert cell.shown[-1] == "[rank 3] late"


def test_a_step_cut_short_by_ctrl_c_prints_what_waits_and_the_collapser_goes_on(monkeypatch, caplog) -> None:
    cell = Cell(ranks=range(3))
    cell.feed(0, "x")
    cell.feed(2, "own")
    add = Collapser._add

    def interrupted(self, entry, rank, queue) -> None:
        entry.ranks.add(rank)  # half of the step done when the signal lands
        raise KeyboardInterrupt

    monkeypatch.setattr(Collapser, "_add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cell.feed(1, "x")
    assert sorted(cell.shown) == ["[rank 0] x", "[rank 1] x", "[rank 2] own"]  # uncollapsed, none lost
    assert "collapsing them was interrupted" in caplog.text and cell.c.pending == 0
    monkeypatch.setattr(Collapser, "_add", add)
    for rank in range(3):
        cell.feed(rank, "y")
    assert cell.shown[-1] == "[ranks 0-2] y"


def test_a_single_rank_run_and_very_long_lines_are_never_held() -> None:
    cell = Cell(ranks=[5])
    cell.feed(5, "hello")
    assert cell.shown == ["[rank 5] hello"]
    cell = Cell()
    cell.feed(0, "x" * (LONGEST + 1))
    assert len(cell.shown) == 1 and cell.c.pending == 0


def test_lines_of_different_attempts_never_collapse_and_say_their_attempt() -> None:
    cell = Cell(ranks=range(2))
    cell.feed(0, "try", attempt=2)
    cell.feed(1, "try", attempt=2)
    assert cell.shown == ["[ranks 0,1, attempt 2] try"]
    cell.feed(0, "again", attempt=2)
    cell.feed(1, "again", attempt=3)
    cell.c.flush()
    assert cell.shown[1:] == ["[rank 0, attempt 2] again", "[rank 1, attempt 3] again"]


# ---------------------------------------------------------------------- random interleavings


def _script(rng: random.Random, ranks: int, lines: int) -> dict[int, list[tuple[str, str]]]:
    """Return what each rank prints: shared lines (some by a subset), its own, repeats, both streams."""
    shared = [f"epoch {i} loss {rng.random():.3f}" for i in range(lines)]
    out: dict[int, list[tuple[str, str]]] = {r: [] for r in range(ranks)}
    for i, text in enumerate(shared):
        printers = range(ranks) if i % 3 else rng.sample(range(ranks), rng.randint(1, ranks))
        for r in printers:
            out[r].append(("stdout", text))
            if rng.random() < 0.3:
                out[r].append(("stdout", f"rank {r} own {rng.randint(0, 9)}"))
            if rng.random() < 0.1:
                out[r].append(("stderr", "warning: same"))
            if rng.random() < 0.05:
                out[r].append(("stdout", ""))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_deliver_every_line_once_in_each_rank_s_order(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([2, 3, 8, 16, 64])
    script = _script(rng, ranks, rng.randint(5, 40))
    cell = Cell(ranks=range(ranks), window=rng.choice([0.01, 0.05, W]))
    sent = {r: [(s, t) for s, t in lines] for r, lines in script.items()}
    cursors = dict.fromkeys(script, 0)
    arrived: dict[int, list[float]] = {r: [] for r in script}
    while any(cursors[r] < len(script[r]) for r in script):
        rank = rng.choice([r for r in script if cursors[r] < len(script[r])])
        stream, text = script[rank][cursors[rank]]
        cursors[rank] += 1
        cell.now += rng.expovariate(1 / 0.004)
        arrived[rank].append(cell.now)
        cell.c.feed(_line(rank, text, stream), cell.now)
        if rng.random() < 0.2:
            cell.at(cell.now)
    cell.c.flush()
    readings = sorted(t for times in arrived.values() for t in times)  # the clock moves only at a call
    delivered: dict[int, list[tuple[str, str]]] = {r: [] for r in script}
    firsts = []
    for line, group, when in cell.emitted:
        assert list(group) == sorted(set(group)) and line.rank in group
        for r in group:
            # out by the first call at or after the window passed (the end's flush, at the latest)
            due = bisect.bisect_left(readings, arrived[r][len(delivered[r])] + cell.c.window)
            assert due == len(readings) or when <= readings[due]
            delivered[r].append((line.stream, line.text))
        if len(group) > 1:
            firsts.append(min(arrived[r][len(delivered[r]) - 1] for r in group))
    assert delivered == sent  # every line, once, in each rank's own order (the multiset follows)
    assert Counter((r, t) for r, ls in delivered.items() for t in ls) == Counter(
        (r, t) for r, ls in sent.items() for t in ls
    )
    assert firsts == sorted(firsts)  # collapsed lines in the order their first copy arrived
    assert cell.c.pending == 0


def test_many_ranks_printing_the_same_lines_collapse_to_one_line_each() -> None:
    cell = Cell(ranks=range(1024), window=60.0)
    rng = random.Random(7)
    for step in range(5):
        order = list(range(1024))
        rng.shuffle(order)
        for rank in order:
            cell.feed(rank, f"step {step} loss 0.5")
    assert cell.shown == [f"[ranks 0-1023] step {step} loss 0.5" for step in range(5)]


# ---------------------------------------------------------------------- labels


def test_rank_and_node_sets_are_written_compactly() -> None:
    assert span_text([0, 1, 2, 3]) == "0-3"
    assert span_text([0, 2]) == "0,2"
    assert span_text([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7,8"
    assert rank_span([3]) == "rank 3" and rank_span([2, 0]) == "ranks 0,2"
    assert node_span([f"n{i}" for i in range(1, 9)]) == "n1-n8"
    assert node_span(["n1", "n3"]) == "n1,n3"
    assert node_span(["gpu-a", "gpu-b"]) == "gpu-a,gpu-b"
    assert node_span(["n08", "n09", "n10"]) == "n08-n10" and node_span(["n9", "n10", "n11"]) == "n9-n11"
    assert node_span(["a1", "a2", "b3", "b4", "b5"]) == "a1,a2,b3-b5"
    assert node_span([f"h{c}" for c in "abcdef"]) == "6 nodes"


def test_labels_across_nodes_name_the_nodes_and_templates_get_the_set() -> None:
    out = io.StringIO()
    hosts = tuple(f"n{i}.cluster.org" for i in range(1, 9))
    sink = PrintSink(stdout=out, num_processes=2, hosts=hosts)
    sink.write(_line(0, "loss"), tuple(range(16)))
    sink.write(_line(4, "x"), (4, 5))
    sink.write(_line(3, "y"), (3,))
    assert out.getvalue().splitlines() == ["[n1-n8 ranks 0-15] loss", "[n3 ranks 4,5] x", "[n2 rank 3] y"]
    out = io.StringIO()
    PrintSink(stdout=out, prefix_template="[{rank}]: ", num_processes=4).write(_line(0, "t"), (0, 1, 2, 3))
    PrintSink(stdout=out, prefix_template="{rank:03d}| ", num_processes=4).write(_line(0, "t"), (0, 1, 2, 3))
    assert out.getvalue().splitlines() == ["[0-3]: t", "[ranks 0-3] t"]  # a numeric format: the default label


# ---------------------------------------------------------------------- the option


def test_collapse_output_values() -> None:
    assert collapse_window(True) == DEFAULT_WINDOW
    assert collapse_window(False) is None
    assert collapse_window(2) == 2.0
    with pytest.raises(
        TypeError, match=r"collapse_output='yes' must be True .*, False .* or a number of seconds"
    ):
        collapse_window("yes")
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(
            ValueError, match=r"collapse_output=.* must be a positive, finite number of seconds"
        ):
            collapse_window(bad)


def test_the_request_checks_the_option_and_the_off_switch_prints_plainly() -> None:
    with pytest.raises(ValueError, match=r"collapse_output=-2 must be a positive, finite number"):
        LaunchRequest(function=print, num_processes=2, collapse_output=-2)
    on = LaunchRequest(function=print, num_processes=2)
    off = LaunchRequest(function=print, num_processes=2, collapse_output=False)
    assert on.collapse_seconds == DEFAULT_WINDOW and off.collapse_seconds is None
    assert LaunchRequest(function=print, num_processes=2, collapse_output=1.5).collapse_seconds == 1.5
    (sink,) = _build_sinks(resolve_plan(on), on)
    assert isinstance(sink, CollapsingPrinter) and sink._collapser.expected == frozenset({0, 1})
    (plain,) = _build_sinks(resolve_plan(off), off)
    assert type(plain) is PrintSink


# ---------------------------------------------------------------------- the launch's printing sink


def test_the_printer_s_timer_prints_a_partial_set_without_a_next_line_and_close_ends_it() -> None:
    out = io.StringIO()
    printer = CollapsingPrinter(PrintSink(stdout=out, num_processes=4), range(4), window=0.05)
    printer(_line(0, "partial"))
    printer(_line(1, "partial"))
    wait_until(
        lambda: out.getvalue() == "[ranks 0,1] partial\n", interval=0.005
    )  # no further line came: the timer did it
    printer(_line(2, "held"))
    printer.announce("Launching the next try")  # a launcher message comes after the lines before it
    assert out.getvalue().splitlines()[-2:] == ["[rank 2] held", "Launching the next try"]
    printer(_line(3, "at the end"))
    thread = printer._thread
    printer.close()
    assert out.getvalue().splitlines()[-1] == "[rank 3] at the end"
    assert thread is not None and not thread.is_alive()
    printer(_line(3, "after"))  # closed: printed at once
    assert out.getvalue().splitlines()[-1] == "[rank 3] after"
    printer.close()  # idempotent


def test_the_printer_starts_no_thread_until_a_line_is_held() -> None:
    out = io.StringIO()
    printer = CollapsingPrinter(PrintSink(stdout=out, num_processes=1), [0])
    printer(_line(0, "alone"))
    printer.announce("plan")
    printer.close()
    assert printer._thread is None and out.getvalue() == "[rank 0] alone\nplan\n"


# ---------------------------------------------------------------------- the interactive ranks' cell sink


def test_the_cell_sink_collapses_a_command_s_lines_and_prints_them_all_by_its_end(capsys) -> None:
    sink = CellSink(printing=True, prefix_template=None, num_processes=3, window=60.0)
    out = io.StringIO()
    printer = PrintSink(stdout=out, stderr=out, num_processes=3)
    sink.begin(printer, targets=[0, 2])  # a command on ranks 0 and 2
    for rank in (0, 2):
        sink(_line(rank, "same"))
    sink(_line(0, "only rank 0"))
    sink.flush(printer)
    assert out.getvalue() == "[ranks 0,2] same\n"  # complete for the command's ranks: out at once
    sink.end(printer)
    assert out.getvalue().splitlines() == ["[ranks 0,2] same", "[rank 0] only rank 0"]
    sink(_line(1, "between commands"))  # no command runs: printed as it comes, into the current cell
    assert capsys.readouterr().out == "[rank 1] between commands\n"


def test_the_cell_sink_without_a_window_prints_every_rank_s_line() -> None:
    sink = CellSink(printing=True, prefix_template=None, num_processes=2, window=None)
    out = io.StringIO()
    printer = PrintSink(stdout=out, num_processes=2)
    sink.begin(printer)
    for rank in (0, 1):
        sink(_line(rank, "same"))
    sink.end(printer)
    assert out.getvalue().splitlines() == ["[rank 0] same", "[rank 1] same"]
