"""The hang rule in a real ipykernel with ``%ranks``: honest work under ``main_process_first()`` survives, a deadlock ends.

The rule itself (launch/hangs.py) is tested on synthetic stacks (tests/test_hangs.py) and through the
Python API (tests/test_interactive_hangs.py); here, what a notebook user sees in the cell.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

from tests.test_interactive_magics import magic_kernel  # noqa: E402  (after the skips: it needs the kernel)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def kernel():
    yield from magic_kernel()


def test_rank_0_working_past_hang_timeout_under_main_process_first_keeps_the_ranks(kernel) -> None:
    kernel.ok("%ranks start 2 --hang-timeout 5")
    try:
        kernel.ok("%%ranks\nkept = rank * 10")
        cell = kernel.ok(
            """
            %%ranks
            import time
            from notebook_accel import PartialState
            with PartialState().main_process_first():
                if rank == 0:
                    time.sleep(10)  # a dataset.map or a checkpoint written by the main process
                prepared = f"prepared on {rank}"
            prepared
            """
        )
        assert cell.out == "[rank 0] 'prepared on 0'\n[rank 1] 'prepared on 1'"
        assert cell.stdout.count("a busy rank is not a hang") == 1, cell.stdout
        assert "rank 1 in barrier" in cell.stdout and "Stacks of rank 0" in cell.stdout
        assert kernel.ok("%%ranks\nkept").out == "[rank 0] 0\n[rank 1] 10"  # the namespaces survived
        assert "a busy rank" not in kernel.ok("%%ranks\nrank").stdout  # the report ended with its command
    finally:
        kernel.ok("%ranks stop")


def test_ranks_receiving_from_each_other_end_the_cell_after_hang_timeout(kernel) -> None:
    kernel.ok("%ranks start 2 --hang-timeout 3")
    try:
        started = time.monotonic()
        cell = kernel.run(
            """
            %%ranks
            import torch, torch.distributed as dist
            dist.recv(torch.zeros(1), src=1 - rank)
            """
        )
        took = time.monotonic() - started
        assert cell.ename == "RankError" and 3 <= took < 3 + 15, (cell.ename, took)
        assert "deadlock: no rank has made progress for hang_timeout=3 s" in cell.evalue
        assert "Stacks of rank 0" in cell.evalue and "Stacks of rank 1" in cell.evalue
        kernel.ok("%ranks restart")
        assert kernel.ok("%%ranks\nrank").out == "[rank 0] 0\n[rank 1] 1"
    finally:
        kernel.ok("%ranks stop")
