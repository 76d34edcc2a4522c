"""Interactive ranks from a real ipykernel: cell functions on the ranks, collectives, Stop, failures, Accelerator."""

from __future__ import annotations

import time

import pytest

from tests.launcher_helpers import printed_by, printed_lines
from tests.test_launcher_kernel import Kernel, interactive_kernel

pytestmark = pytest.mark.timeout(180)

ENSURE = """
import time, torch, notebook_accel
from notebook_accel import interactive
ranks = interactive.current() or notebook_accel.start_ranks(2)
if not ranks.alive:
    ranks.restart()
"""


@pytest.fixture(scope="module")
def kernel():
    yield from interactive_kernel("def helper(x):\n    return x + 100\nkernel_value = 'from the kernel'")


def test_cell_functions_and_all_reduce_on_the_ranks(kernel: Kernel) -> None:
    out = kernel.ok(ENSURE)
    assert "Launching 2 process(es) | backend gloo" in out
    out = kernel.ok("print(ranks.run('helper(rank), kernel_value'))")
    assert "[(100, 'from the kernel'), (101, 'from the kernel')]" in out
    out = kernel.ok(
        "print(ranks.run('import torch.distributed as dist\\nt = torch.ones(1) * (rank + 1)\\n"
        'dist.all_reduce(t)\\nprint("reduced", t.item())\\nt.item()\'))',
    )
    # the ranks' lines land in the running cell, before the result (once as [ranks 0,1] when close together)
    assert out.index("reduced 3.0") < out.index("[3.0, 3.0]")
    assert sorted(printed_by(out, "reduced 3.0")) == [0, 1]
    # IPython's display() on a rank shows in the cell, labelled (not into the kernel's forked sockets)
    out, shown = _run_collecting_displays(
        kernel, "ranks.run('from IPython.display import display\\ndisplay(\"shown\", rank)')"
    )
    assert "[rank 0] 'shown'" in shown and "[rank 1] 1" in shown, (out, shown)


def test_a_cell_s_identical_prints_show_once_labelled_with_the_ranks(kernel: Kernel) -> None:
    # A long window makes the grouping exact on a loaded machine: a line both ranks printed goes out as
    # soon as the second did, a line one rank printed at the end of the command at the latest.
    kernel.ok("interactive.current() and interactive.current().stop()")
    kernel.ok("import notebook_accel\nranks = notebook_accel.start_ranks(2, collapse_output=60)")
    try:
        code = "import sys\nprint('same line')\nprint('own', rank)\nprint('a warning', file=sys.stderr)"
        status, out, err, _ = kernel.run(f"ranks.run({code!r})")
        assert status == "ok", err
        assert out.count("same line") == 1 and "[ranks 0,1] same line\n" in out, out
        assert "[rank 0] own 0\n" in out and "[rank 1] own 1\n" in out
        assert err.count("a warning") == 1 and "[ranks 0,1] a warning\n" in err, err
        # the handle (what the panel's per-rank view reads) keeps every rank's copy
        kept = kernel.ok("print([[line.text for line in ranks.handle.lines(r)] for r in (0, 1)])")
        assert kept.strip() == "[['same line', 'own 0', 'a warning'], ['same line', 'own 1', 'a warning']]"
    finally:
        kernel.ok("ranks.stop()")


def test_stop_button_interrupts_every_rank_and_the_next_cell_works(kernel: Kernel) -> None:
    kernel.ok(ENSURE + "\nranks.run('kept = rank * 2')")
    seconds, out, err = kernel.interrupted(
        "ranks.run('print(\"sleeping\", flush=True)\\ntime.sleep(60)')", after="sleeping"
    )
    assert seconds < 5 + 3  # < 5 s after the interrupt (the ranks printed first)
    assert "namespaces intact" in err
    out = kernel.ok("print(ranks.run('kept'), ranks.alive)")
    assert "[0, 2] True" in out


def test_error_on_rank_1_while_rank_0_waits_in_all_reduce(kernel: Kernel) -> None:
    kernel.ok(ENSURE)
    started = time.monotonic()
    status, out, err, ename = kernel.run(
        'ranks.run(\'import torch.distributed as dist\\nif rank == 1:\\n    raise KeyError("rank one broke")\\n'
        "dist.all_reduce(torch.ones(1))')",
        timeout=90,
    )
    assert status == "error" and ename == "RankError", (status, out, err)
    assert time.monotonic() - started < 60 + 5
    assert "Traceback of rank 1" in err and "KeyError: 'rank one broke'" in err
    assert "rank 0 in all_reduce" in err and "Stacks of rank 0" in err
    status, out, err, _ = kernel.run(
        "print(ranks.broken)\nprint(ranks.restart())\nprint(ranks.run('rank'), ranks.broken)"
    )
    assert status == "ok", err
    assert out.startswith("True\n") and out.endswith("[0, 1]\n[0, 1] False\n")
    assert "the namespaces of ranks [0, 1] were lost" in err


def test_accelerator_steps_cell_by_cell_keep_the_ranks_in_sync(kernel: Kernel) -> None:
    kernel.ok(ENSURE)
    out = kernel.ok(
        "print(ranks.run('from notebook_accel import Accelerator\\nacc = Accelerator()\\n"
        "(acc.num_processes, acc.process_index)'))",
    )
    assert "[(2, 0), (2, 1)]" in out
    kernel.ok(
        "ranks.run('torch.manual_seed(rank)\\nmodel = torch.nn.Linear(4, 1)\\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\\nmodel, opt = acc.prepare(model, opt)\\n"
        "start = acc.unwrap_model(model).weight.detach().clone()')",
    )
    step = (
        "x = torch.randn(8, 4) + rank\\nloss = model(x).pow(2).mean()\\nacc.backward(loss)\\n"
        "opt.step()\\nopt.zero_grad()\\nloss.item()"
    )
    for _ in range(3):  # one cell per step
        kernel.ok(f"print(ranks.run('{step}'))")
    out = kernel.ok(
        "w = ranks.run('acc.unwrap_model(model).weight.detach()')\n"
        "moved = ranks.run('(acc.unwrap_model(model).weight - start).abs().max().item()')\n"
        "print('EQUAL', torch.equal(w[0], w[1]), 'MOVED', min(moved) > 0)",
    )
    assert "EQUAL True MOVED True" in out
    out = kernel.ok("import psutil\nranks.stop()\nprint(interactive.current(), psutil.Process().children())")
    assert "None []" in out


def _run_collecting_displays(kernel: Kernel, code: str, timeout: float = 60) -> tuple[str, list[str]]:
    """Return (stdout and stderr, the text/plain of every display and display update) of one cell."""
    out: list[str] = []
    shown: list[str] = []
    for msg in kernel.cell(code, timeout):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind in ("display_data", "update_display_data"):
            shown.append(content["data"].get("text/plain", ""))
        elif kind == "error":
            raise AssertionError("\n".join(content["traceback"]))
    return "".join(out), shown


def test_a_commands_progress_bars_are_drawn_live_in_its_cell(kernel: Kernel) -> None:
    kernel.ok(ENSURE)
    out, shown = _run_collecting_displays(
        kernel,
        "ranks.run('from tqdm.auto import tqdm\\nfor i in tqdm(range(40), desc=\"steps\"):\\n    time.sleep(0.05)')",
    )
    live = [text for text in shown if "[rank 0] steps:" in text]
    assert live, (out, shown)  # the open bar, redrawn in place while the command ran
    # the closed bar's last line, with the rank's other lines (stderr; shared by ranks whose bars ended alike)
    assert any(0 in ranks for ranks, text in printed_lines(out) if text.startswith("steps: 100%")), out


def test_the_ranks_end_with_the_kernel() -> None:
    import psutil

    k = Kernel()
    try:
        out = k.ok(
            "import notebook_accel\nranks = notebook_accel.start_ranks(2)\nprint('PIDS', ranks.handle.pids)",
        )
        pids = eval(out.split("PIDS", 1)[1].strip())
        assert all(psutil.pid_exists(pid) for pid in pids)
    finally:
        k.close()  # the kernel is killed: no clean-up code of it runs
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
