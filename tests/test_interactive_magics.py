"""The %ranks / %%ranks magics: the display model and the argument checks without a kernel, then every
magic in a real ipykernel with 2 gloo ranks (start, cells on all or some ranks, equal values shown once,
auto mode, pull/push, status, stacks, restart, stop, and each bad-usage message)."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from notebook_accel.interactive import CellResult, ValueOnRankError
from notebook_accel.interactive.display import CellDisplay, StacksView, StatusTable, rank_label
from notebook_accel.interactive.magics import SUBCOMMANDS, RanksMagic, RanksUsageError, parse_ranks
from tests.launcher_helpers import StartedKernel, printed_by, shows


def _Result(rank: int, value: Any, text: str | None, html: str | None = None, ok: bool = True) -> CellResult:  # noqa: N802
    """What ``Ranks.execute`` gives per rank for a value that came to the kernel (compared with ``==``)."""
    return CellResult(rank, value, text, html, ok, shipped=value is not None)


def _results(*values: Any) -> list[_Result]:
    return [_Result(rank, value, None if value is None else repr(value)) for rank, value in enumerate(values)]


# -- the display model ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "world", "label"),
    [
        ((1,), 2, "[rank 1]"),
        ((0, 1), 2, "[all 2 ranks]"),
        ((0, 2), 4, "[ranks 0,2]"),
        ((2, 3), 4, "[ranks 2,3]"),
    ],
)
def test_rank_label(ranks, world, label) -> None:
    assert rank_label(ranks, world) == label


def test_equal_values_are_shown_once_and_marked() -> None:
    shown = CellDisplay(_results(6, 6), world_size=2)
    assert shown.all_equal and repr(shown) == "[all 2 ranks] 6"
    assert shown.values == [6, 6]
    assert shown._repr_html_() is None  # no rank had HTML: the text form is the whole display


def test_different_values_are_shown_per_rank_in_rank_order() -> None:
    results = _results(0, 1)[::-1]  # replies may come back in any order
    shown = CellDisplay(results, world_size=2)
    assert not shown.all_equal
    assert repr(shown) == "[rank 0] 0\n[rank 1] 1"
    assert shown.values == [0, 1]


def test_ranks_sharing_a_value_are_grouped_and_multi_line_values_start_under_their_label() -> None:
    results = [_Result(0, "a", "x\ny"), _Result(1, "b", "z"), _Result(2, "a", "x\ny")]
    shown = CellDisplay(results, world_size=3)
    assert repr(shown) == "[ranks 0,2]\nx\ny\n[rank 1] z"


def test_statements_and_none_show_nothing() -> None:
    assert CellDisplay(_results(None, None), world_size=2).empty
    shown = CellDisplay(_results(None, 5), world_size=2)
    assert repr(shown) == "[rank 1] 5"


def test_some_ranks_with_equal_values_name_those_ranks() -> None:
    shown = CellDisplay([_Result(0, 1, "1"), _Result(2, 1, "1")], world_size=4)
    assert repr(shown) == "[ranks 0,2] 1"


def test_html_values_render_once_with_their_label() -> None:
    table = "<table><tr><td>1</td></tr></table>"
    shown = CellDisplay([_Result(0, 1, "t", table), _Result(1, 1, "t", table)], world_size=2)
    html = shown._repr_html_()
    assert html.count(table) == 1 and "[all 2 ranks]" in html
    # A rank without HTML next to one with it: its text is escaped into a <pre>.
    mixed = CellDisplay([_Result(0, 1, "t", table), _Result(1, 2, "<2>")], world_size=2)._repr_html_()
    assert "<pre>&lt;2&gt;</pre>" in mixed and "[rank 1]" in mixed


def test_values_that_print_alike_but_differ_are_shown_apart_and_said_to_differ() -> None:
    text = "tensor([0., 0., 0.,  ..., 0., 0., 0.])"
    # Values that stayed on their ranks: compared by the digests the ranks computed.
    differ = [CellResult(r, text=text, digest=d, stayed="pull it") for r, d in ((0, "aa"), (1, "bb"))]
    shown = CellDisplay(differ, world_size=2)
    assert not shown.all_equal
    assert (
        repr(shown)
        == f"[rank 0] {text}\n[rank 1] {text}\n(ranks 0 and 1 print alike but their values differ)"
    )
    assert (
        "print alike but their values differ"
        in CellDisplay(
            [
                CellResult(0, text="t", html="<b>t</b>", digest="a"),
                CellResult(1, text="t", html="<b>t</b>", digest="b"),
            ],
            world_size=2,
        )._repr_html_()
    )
    same = [CellResult(r, text=text, digest="aa", stayed="pull it") for r in range(3)]
    assert repr(CellDisplay(same, world_size=3)) == f"[all 3 ranks] {text}"
    # Three ranks: two equal, one apart though it prints the same.
    mixed = [CellResult(r, text="x", digest=d) for r, d in ((0, "a"), (1, "b"), (2, "a"))]
    assert (
        repr(CellDisplay(mixed, world_size=3))
        == "[ranks 0,2] x\n[rank 1] x\n(ranks 0, 1 and 2 print alike but their values differ)"
    )
    # No digest and no value here: never taken for equal.
    unknown = [CellResult(r, text="x") for r in range(2)]
    assert "print alike" in repr(CellDisplay(unknown, world_size=2))


def test_values_that_came_are_compared_with_eq_and_those_that_stayed_say_how_to_pull() -> None:
    # Equal by == though their digests differ (dicts in another order).
    a, b = {"x": 1, "y": 2}, {"y": 2, "x": 1}
    shown = CellDisplay([_Result(0, a, repr(a)), _Result(1, b, repr(b))], world_size=2)
    assert shown.all_equal and shown.values == [a, b]
    stayed = CellDisplay(
        [
            CellResult(
                0,
                text="t",
                digest="d",
                stayed="the value of rank 0 stayed on the rank: use ranks.pull('_', on=0)",
            )
        ]
        + [CellResult(1, 5, "5", shipped=True)],
        world_size=2,
    )
    with pytest.raises(
        ValueOnRankError, match=r"rank\(s\) \[0\] stayed on the ranks.*ranks\.pull\('_', on=0\)"
    ):
        _ = stayed.values
    with pytest.raises(ValueOnRankError, match="ranks.pull"):
        _ = stayed.results[0].value
    assert stayed.results[1].value == 5


def test_status_table_and_stacks_view() -> None:
    rows = [
        SimpleNamespace(rank=0, pid=11, state="idle", cell=None, cpu_percent=0.0, rss=50 * 2**20),
        SimpleNamespace(
            rank=1, pid=12, state="running", cell="time.sleep(60)\nx = 1", cpu_percent=98.6, rss=None
        ),
    ]
    text = repr(StatusTable(rows)).splitlines()
    assert text[0].split() == ["rank", "pid", "state", "cell", "cpu", "%", "memory"]
    assert text[1].split() == ["0", "11", "idle", "-", "0", "50.0", "MiB"]
    assert text[2].split() == ["1", "12", "running", "time.sleep(60)", "99", "-"]
    assert "<td>running</td>" in StatusTable(rows)._repr_html_()
    stuck = SimpleNamespace(text="main:\n  sleep", summary=lambda: "in all_reduce (<rank cell 3>:2)")
    waiting = SimpleNamespace(text="main:\n  wait", summary=lambda: "at <rank cell 3>:1 (time.sleep(9))")
    view = repr(StacksView({1: stuck, 0: waiting}))
    assert view == "[rank 0] at <rank cell 3>:1 (time.sleep(9))\nmain:\n  wait\n\n" + (
        "[rank 1] in all_reduce (<rank cell 3>:2)\nmain:\n  sleep"
    )


# -- argument checks (no ranks are running in this process) --------------------------------------


def test_parse_ranks() -> None:
    assert parse_ranks("") is None and parse_ranks("all") is None
    assert parse_ranks("0") == [0] and parse_ranks("0,2") == [0, 2] and parse_ranks(" 1, 3 ") == [1, 3]
    with pytest.raises(RanksUsageError, match=r"like `%%ranks 0` or `%%ranks 0,2`; got 'start 2'"):
        parse_ranks("start 2")
    with pytest.raises(RanksUsageError, match="a rank is named twice"):
        parse_ranks("1,1")


@pytest.fixture()
def magic() -> RanksMagic:
    return RanksMagic(SimpleNamespace(user_ns={"w": 1}))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "",
            "%ranks needs a command, one of: start, stop, status, stacks, restart, pull, push, auto, value-limit, wait, jobs",
        ),
        (
            "launch 2",
            "unknown command 'launch'; use one of: start, stop, status, stacks, restart, pull, push, auto, value-limit, wait, jobs",
        ),
        ("0,1", r"To run code on rank\(s\) 0,1, start a cell with `%%ranks 0,1`"),
        ("start two", r"%ranks start: argument N: invalid int value: 'two'"),
        ("start 2 --spawn", r"%ranks start: unrecognized arguments: --spawn"),
        (
            "start 2 --collapse-output maybe",
            r"argument --collapse-output: --collapse-output maybe: give on \(identical lines of several ranks "
            r"shown once\), off, or the seconds a line waits for the other ranks \(like 0.5\)",
        ),
        ("start 2 --collapse-output 0", r"--collapse-output 0: give on"),
        ("auto", r"%ranks auto: the following arguments are required: on\|off"),
        ("pull 'w", r"%ranks pull 'w: No closing quotation; close the quote"),
        ("auto maybe", r"%ranks auto: argument on\|off: invalid choice: 'maybe'"),
        ("pull", "%ranks pull: the following arguments are required: NAME"),
        ("pull w.x", r"'w.x' is not a variable name; give a name like `%ranks pull weights`"),
        ("push nope", r"%ranks push: the kernel has no variable 'nope'; define it in a cell first"),
        ("status", r"%ranks status: no ranks are running. Start them first with `%ranks start N`"),
        ("stacks", r"%ranks stacks: no ranks are running"),
        ("restart", r"%ranks restart: no ranks are running"),
        ("pull w", r"%ranks pull: no ranks are running"),
        ("push w", r"%ranks push: no ranks are running"),
        ("auto on", r"%ranks auto on: no ranks are running"),
        ("wait", r"%ranks wait: no ranks are running"),
        ("wait x", r"%ranks wait: argument JOB: invalid int value: 'x'"),
        ("jobs", r"%ranks jobs: no ranks are running"),
    ],
)
def test_bad_line_magic_usage_names_the_problem_and_the_fix(magic, line, message) -> None:
    with pytest.raises(RanksUsageError, match=message):
        magic.line(line)
    assert magic.auto is False


def test_cell_magic_before_start_says_how_to_start(magic) -> None:
    with pytest.raises(
        RanksUsageError, match=r"%%ranks: no ranks are running. Start them first with `%ranks start N`"
    ):
        magic.cell("", "x = 1")


def test_stop_without_ranks_is_harmless(magic) -> None:
    assert magic.line("stop") is None
    assert SUBCOMMANDS[0] == "start"


def test_auto_transform_makes_cells_ranks_cells_except_magics(magic) -> None:
    cell = ["x = 1\n", "x\n"]
    assert magic.auto_transform(cell) == cell  # off: untouched
    magic.auto = True
    assert magic.auto_transform(cell) == ["%%ranks\n", *cell]
    for kernel_cell in (
        ["%ranks auto off\n"],
        ["%%ranks 0\n", "x\n"],
        ["%time x\n"],
        ["!ls\n"],
        ["\n", "  \n"],
    ):
        assert magic.auto_transform(kernel_cell) == kernel_cell


# -- in a real kernel -------------------------------------------------------------------------------

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")


@dataclass
class Cell:
    """What a kernel cell gave: status, streams, its Out[] (text and HTML), the error it raised."""

    status: str
    stdout: str
    stderr: str
    out: str | None
    html: str | None
    ename: str | None
    evalue: str | None
    displayed: list[dict]
    """The mime bundles the cell displayed (``display_data``), e.g. a panel."""
    traceback: list[str]
    """The error's traceback lines as the notebook shows them."""


class MagicKernel(StartedKernel):
    """An ipykernel with ``%load_ext notebook_accel`` done; ``run(code)`` returns a :class:`Cell`."""

    def run(self, code: str, timeout: float = 120, interrupt_after: str | Callable | None = None) -> Cell:
        """Run ``code``; with ``interrupt_after``, press Stop once that text was printed (or it says so of stdout)."""
        streams = {"stdout": [], "stderr": []}
        result: dict[str, Any] = {}
        error: dict[str, str] = {}
        displayed: list[dict] = []
        pressed: list[bool] = []

        def hook(msg: dict) -> None:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                streams[content["name"]].append(content["text"])
                if interrupt_after and not pressed and shows(interrupt_after, "".join(streams["stdout"])):
                    pressed.append(True)  # once: a second press while the first is handled means more
                    self.km.interrupt_kernel()
            elif kind == "execute_result":
                result.update(content["data"])
            elif kind == "display_data":
                displayed.append(content["data"])
            elif kind == "error":
                error.update(ename=content["ename"], evalue=content["evalue"], traceback=content["traceback"])

        reply = self.kc.execute_interactive(textwrap.dedent(code), timeout=timeout, output_hook=hook)
        # IPython shows a UsageError on stderr, with no error message: the reply names it.
        if reply["content"]["status"] == "error" and not error:
            error.update(ename=reply["content"]["ename"], evalue=reply["content"]["evalue"])
        return Cell(
            reply["content"]["status"],
            "".join(streams["stdout"]),
            "".join(streams["stderr"]),
            result.get("text/plain"),
            result.get("text/html"),
            error.get("ename"),
            error.get("evalue"),
            displayed,
            error.get("traceback", []),
        )

    def ok(self, code: str, timeout: float = 120) -> Cell:
        """Run ``code`` and assert it did not raise."""
        cell = self.run(code, timeout)
        assert cell.status == "ok", f"{code!r} failed: {cell.ename}: {cell.evalue}\n{cell.stderr}"
        return cell


def magic_kernel(setup: str = "") -> Iterator[MagicKernel]:
    """Yield a :class:`MagicKernel` that loaded the extension and ran ``setup``; then stop its ranks, close it."""
    k = MagicKernel()
    k.ok("%load_ext notebook_accel\n" + setup)
    yield k
    k.run("%ranks stop")
    k.close()


@pytest.fixture(scope="module")
def kernel():
    yield from magic_kernel("import psutil\nbefore_start = 7")


@pytest.fixture()
def ranks(kernel):
    """Two running ranks in the kernel, stopped after the test (no process left behind)."""
    kernel.ok("%ranks start 2")
    yield kernel
    kernel.ok("%ranks stop")
    left = kernel.ok("[p.pid for p in psutil.Process().children(recursive=True) if p.status() != 'zombie']")
    assert left.out == "[]", f"processes left after %ranks stop: {left.out}"


@pytest.mark.timeout(300)
def test_cells_run_on_every_rank_or_on_some_and_show_their_values(ranks) -> None:
    assert ranks.ok("%%ranks\nrank").out == "[rank 0] 0\n[rank 1] 1"
    # Forked from the kernel: the ranks see what the kernel defined before %ranks start.
    assert ranks.ok("%%ranks\nbefore_start * world_size").out == "[all 2 ranks] 14"
    reduced = ranks.ok(
        """
        %%ranks
        import torch, torch.distributed as dist
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t)
        t
        """
    )
    assert reduced.out == "[all 2 ranks] tensor([3., 3.])"  # equal on every rank: shown once
    one = ranks.ok("%%ranks 1\nprint('hello from', rank)\nt * rank")
    assert one.stdout == "[rank 1] hello from 1\n" and one.out == "[rank 1] tensor([3., 3.])"
    both = ranks.ok("%%ranks 0,1\nrank * 10")
    assert both.out == "[rank 0] 0\n[rank 1] 10"
    # A statement shows nothing, as in Jupyter; the namespaces persist between cells.
    assert ranks.ok("%%ranks\ny = rank + 100").out is None
    assert ranks.ok("%%ranks\ny").out == "[rank 0] 100\n[rank 1] 101"
    # A trailing semicolon hides the value, as for any cell; Out[] keeps every rank's value.
    assert ranks.ok("%%ranks\ny;").out is None
    assert ranks.ok("%%ranks\ny").out and ranks.ok("_.values").out == "[100, 101]"
    # HTML values render through the display, labelled.
    html = ranks.ok(
        "%%ranks\nclass H:\n    def _repr_html_(self):\n        return '<b>h</b>'\n    def __repr__(self):\n"
        "        return 'H()'\nH()"
    )
    assert html.html is not None and "[all 2 ranks]" in html.html and "<b>h</b>" in html.html


@pytest.mark.timeout(300)
def test_pull_assigns_the_list_in_the_kernel_and_push_sends_the_kernel_value(ranks) -> None:
    ranks.ok("%%ranks\nt = rank * 10")
    pulled = ranks.ok("%ranks pull t")
    assert pulled.out == "[0, 10]"
    assert ranks.ok("t, type(t).__name__").out == "([0, 10], 'list')"
    assert ranks.ok("only_one = %ranks pull t --on 1\nonly_one").out == "[10]"
    ranks.ok("w = {'a': 1}\nv = 2\n%ranks push w v")
    assert ranks.ok("%%ranks\nw['a'] + v + rank").out == "[rank 0] 3\n[rank 1] 4"
    ranks.ok("w = {'a': 5}\n%ranks push w --on 1")
    assert ranks.ok("%%ranks\nw['a']").out == "[rank 0] 1\n[rank 1] 5"
    # A value that cannot be pickled refuses the whole push: `v` was not sent either.
    refused = ranks.run("v = 3\nlock = __import__('threading').Lock()\n%ranks push v lock")
    assert refused.status == "error" and "lock" in refused.evalue
    assert ranks.ok("%%ranks\nv").out == "[all 2 ranks] 2"


@pytest.mark.timeout(300)
def test_auto_mode_runs_every_cell_on_the_ranks_until_switched_off(ranks) -> None:
    ranks.ok("%ranks auto on")
    assert ranks.ok("z = rank * 2\nz").out == "[rank 0] 0\n[rank 1] 2"
    # Magic cells stay in the kernel: %ranks status answers there, with the ranks idle.
    assert "idle" in ranks.ok("%ranks status").out
    ranks.ok("%ranks auto off")
    # The kernel runs cells again: it has no `z` (only the ranks do).
    assert ranks.run("z").ename == "NameError"
    assert ranks.ok("%%ranks\nz").out == "[rank 0] 0\n[rank 1] 2"
    # Stopping the ranks ends auto mode with them, so the next cell runs in the kernel.
    ranks.ok("%ranks auto on\n")
    ranks.ok("%ranks stop")
    assert ranks.ok("1 + 1").out == "2"
    ranks.ok("%ranks start 2")


@pytest.mark.timeout(300)
def test_status_stacks_restart_and_stop(ranks) -> None:
    status = ranks.ok("%ranks status")
    lines = status.out.splitlines()
    assert lines[0].split()[:4] == ["rank", "pid", "state", "cell"]
    assert [ln.split()[0] for ln in lines[1:]] == ["0", "1"] and all("idle" in ln for ln in lines[1:])
    assert "<table>" in status.html
    # Between cells every rank waits for a command: said in one line each, not the loop's frames.
    assert ranks.ok("%ranks stacks").out == (
        "[rank 0] idle, waiting for a command\n\n[rank 1] idle, waiting for a command"
    )
    ranks.ok("%%ranks\nkept = 1")
    restarted = ranks.ok("%ranks restart")
    assert "the namespaces of ranks [0, 1] were lost" in restarted.stderr
    assert ranks.ok("%%ranks\n'kept' in globals()").out == "[all 2 ranks] False"
    assert ranks.ok("%%ranks\nrank").out == "[rank 0] 0\n[rank 1] 1"  # fresh ranks work


@pytest.mark.timeout(300)
def test_start_options_reach_start_ranks(kernel) -> None:
    started = kernel.ok("%ranks start 2 --start-method fork --hang-timeout 30 --collapse-output off")
    assert started.out == "<Ranks 2 rank(s), alive>"  # Out[] is the Ranks object: `r = %ranks start 2`
    try:
        # The options the running group was started with (Ranks keeps them for restart()).
        opts = kernel.ok("from notebook_accel import interactive\ninteractive.current()._options").out
        assert "'hang_timeout': 30.0" in opts and "'start_method': 'fork'" in opts
        assert "'collapse_output': False" in opts
        assert kernel.ok("%%ranks\nworld_size").out == "[all 2 ranks] 2"
        # collapsing off: each rank's copy of a line both print
        printed = kernel.ok("%%ranks\nprint('same')").stdout
        assert sorted(printed.splitlines()) == ["[rank 0] same", "[rank 1] same"]
    finally:
        kernel.ok("%ranks stop")
    # --panel shows the launch panel (a widget, with its text form) for the ranks.
    panel = kernel.ok("%ranks start 2 --panel")
    try:
        views = [d for d in panel.displayed if "application/vnd.jupyter.widget-view+json" in d]
        assert views and views[0]["text/plain"].startswith("LaunchPanel(")
        assert kernel.ok("%%ranks\nrank").out == "[rank 0] 0\n[rank 1] 1"
    finally:
        kernel.ok("%ranks stop")
    bad = kernel.run("%ranks start 2 --start-method bogus")
    assert bad.status == "error" and "bogus" in bad.evalue


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("code", "message"),
    [
        (
            "%ranks",
            "%ranks needs a command, one of: start, stop, status, stacks, restart, pull, push, auto, value-limit, wait, jobs",
        ),
        ("%ranks launch", "unknown command 'launch'; use one of: start, stop, status"),
        ("%%ranks\nrank", "%%ranks: no ranks are running. Start them first with `%ranks start N`"),
        ("%%ranks start\nrank", "%%ranks takes the ranks to run the cell on, like `%%ranks 0`"),
        ("%ranks auto on", "%ranks auto on: no ranks are running"),
        ("%ranks push undefined_here", "the kernel has no variable 'undefined_here'"),
    ],
)
def test_bad_usage_in_a_kernel_is_a_usage_error_with_the_fix(kernel, code, message) -> None:
    cell = kernel.run(code)
    assert (cell.status, cell.ename) == ("error", "UsageError")
    assert message in cell.evalue


@pytest.mark.timeout(300)
def test_bad_usage_with_running_ranks(ranks) -> None:
    again = ranks.run("%ranks start 2")
    assert again.ename == "UsageError" and "2 ranks are already running" in again.evalue
    assert "%ranks stop" in again.evalue
    missing = ranks.run("%%ranks 0,5\nrank")
    assert missing.ename == "UsageError" and "rank 5 does not exist; these ranks are 0..1" in missing.evalue
    # The refused cells changed nothing: the ranks still answer.
    assert ranks.ok("%%ranks\nrank").out == "[rank 0] 0\n[rank 1] 1"


@pytest.mark.timeout(300)
def test_stop_button_interrupts_a_ranks_cell_on_every_rank_and_keeps_the_namespaces(ranks) -> None:
    ranks.ok("%%ranks\nkept = rank")
    start = time.monotonic()
    cell = ranks.run(
        "%%ranks\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)",
        interrupt_after=lambda out: 1 in printed_by(out, "sleeping"),  # alone or as [ranks 0,1]
    )
    assert cell.ename == "KeyboardInterrupt" and time.monotonic() - start < 30
    assert ranks.ok("%%ranks\nkept").out == "[rank 0] 0\n[rank 1] 1"


@pytest.mark.timeout(300)
def test_a_rank_raising_while_the_other_waits_in_all_reduce_ends_the_cell_and_restart_recovers(
    kernel,
) -> None:
    kernel.ok("%ranks start 2 --hang-timeout 3")
    try:
        start = time.monotonic()
        cell = kernel.run(
            """
            %%ranks
            import torch, torch.distributed as dist
            if rank == 1:
                raise ValueError("bad batch on rank 1")
            dist.all_reduce(torch.ones(1))
            """
        )
        assert cell.ename == "RankError" and time.monotonic() - start < 3 + 5 + 10
        assert cell.evalue.startswith("rank 1 ") and "bad batch on rank 1" in cell.evalue
        # Shown as the ranks' error only (IPython's _render_traceback_), not the kernel's plumbing.
        assert cell.traceback[0].startswith("RankError: rank 1 ") and "magics.py" not in "".join(
            cell.traceback
        )
        assert "broken" in cell.evalue and "%ranks restart" in cell.evalue
        assert all("dead" in ln for ln in kernel.ok("%ranks status").out.splitlines()[1:])
        kernel.ok("%ranks restart")
        assert kernel.ok("%%ranks\nrank").out == "[rank 0] 0\n[rank 1] 1"
    finally:
        kernel.ok("%ranks stop")


@pytest.mark.timeout(300)
def test_an_accelerator_trained_cell_by_cell_keeps_equal_weights_on_both_ranks(ranks) -> None:
    ranks.ok("import torch\ntorch.manual_seed(0)\nnet = torch.nn.Linear(4, 1)")
    ranks.ok("%ranks restart")  # fork again, now with the kernel's `net`
    prepared = ranks.ok(
        """
        %%ranks
        from notebook_accel import Accelerator
        accelerator = Accelerator()
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        data = torch.Generator().manual_seed(rank)
        def step():
            x = torch.randn(8, 4, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()
        accelerator.num_processes, accelerator.process_index
        """
    )
    assert prepared.out == "[rank 0] (2, 0)\n[rank 1] (2, 1)"
    losses = [ranks.ok("%%ranks\nstep()").out for _ in range(3)]
    assert all(out.startswith("[rank 0] ") and "\n[rank 1] " in out for out in losses)  # own batches
    ranks.ok("%%ranks\nw = accelerator.unwrap_model(model).weight.detach().clone()")
    ranks.ok("%ranks pull w")
    assert ranks.ok("torch.equal(w[0], w[1]), torch.equal(w[0], net.weight)").out == "(True, False)"
