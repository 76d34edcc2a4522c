"""Collapsed output of real launches: gloo ranks printing alike, from a plain process and from a kernel.

The cell (printed output) shows a line all ranks printed once, labelled with the rank set; the handle's
``lines()`` and the ``log_dir`` files keep every rank's copy. A long window makes the grouping exact
whatever the load: a set goes out when it is complete, a partial one at the end of the launch.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from notebook_accel.launchers import notebook_launcher
from tests.launcher_helpers import printed_by
from tests.test_launcher_kernel import Kernel

pytestmark = [pytest.mark.timeout(120)]


def _same_and_own() -> int:
    dist.init_process_group("gloo")
    dist.barrier()
    print("same", flush=True)
    if dist.get_rank() == 2:
        print("own", flush=True)
    dist.barrier()
    return dist.get_rank()


@pytest.mark.usefixtures("no_launch_leaks")
def test_four_ranks_printing_one_line_show_it_once_and_the_history_and_logs_keep_every_copy(
    capsys, tmp_path
) -> None:
    handle = notebook_launcher(
        _same_and_own, num_processes=4, log_dir=tmp_path, block=False, collapse_output=60.0
    )
    assert handle.result(timeout=100) == [0, 1, 2, 3]
    out = capsys.readouterr().out
    printed = [line for line in out.splitlines() if not line.startswith("Launching")]
    assert printed.count("[ranks 0-3] same") == 1 and "[rank 2] own" in printed, out
    assert printed_by(out, "same") == [0, 1, 2, 3] and printed_by(out, "own") == [2]
    assert len(printed) == 2, out
    for rank in range(4):
        expected = ["same", "own"] if rank == 2 else ["same"]
        assert [line.text for line in handle.lines(rank)] == expected
        log = (tmp_path / handle.run_id / f"rank_{rank}" / "stdout.log").read_text()
        assert log.splitlines() == expected


@pytest.mark.usefixtures("no_launch_leaks")
def test_collapse_output_false_prints_every_rank_s_line(capsys) -> None:
    assert notebook_launcher(_same_and_own, num_processes=4, collapse_output=False) == [0, 1, 2, 3]
    out = capsys.readouterr().out
    assert sorted(line for line in out.splitlines() if line.endswith("same")) == [
        f"[rank {r}] same" for r in range(4)
    ]


def test_a_bad_collapse_output_is_refused_before_anything_starts() -> None:
    with pytest.raises(TypeError, match=r"collapse_output='off' must be True .* False .* or a number"):
        notebook_launcher(_same_and_own, num_processes=4, collapse_output="off")
    with pytest.raises(ValueError, match=r"collapse_output=0 must be a positive, finite number of seconds"):
        notebook_launcher(_same_and_own, num_processes=4, collapse_output=0)


def test_collapse_output_is_refused_where_torch_elastic_prints_the_lines_itself() -> None:
    with pytest.raises(ValueError, match=r"collapse_output=False is not available with num_nodes > 1 .*True"):
        notebook_launcher(_same_and_own, num_processes=2, num_nodes=2, collapse_output=False)


def test_in_a_kernel_the_timer_prints_a_partial_set_into_the_running_cell() -> None:
    """Ranks 0 and 1 print a line rank 2 never prints: it shows after the window, while the launch runs.

    The cell is interrupted as soon as the collapsed line arrives; without the timer thread's write
    reaching the running cell it would only show at the end, 60 s later.
    """
    kernel = Kernel()
    try:
        seconds, out, _ = kernel.interrupted(
            """
            import time, torch.distributed as dist
            from notebook_accel import notebook_launcher
            def work():
                dist.init_process_group("gloo")
                dist.barrier()
                if dist.get_rank() < 2:
                    print("partial", flush=True)
                time.sleep(60)
            notebook_launcher(work, num_processes=3, collapse_output=2.0)
            """,
            timeout=100,
            after="[ranks 0,1] partial\n",
        )
        assert seconds < 50
        assert out.count("partial") == 1, out
    finally:
        kernel.close()
