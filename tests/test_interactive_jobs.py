"""Background jobs on interactive ranks (``ranks.submit``, ``%%ranks --bg``) from a plain process.

A real 2-rank gloo group forked from pytest serves the module. Jobs that must keep running while the
test looks at them wait for a file the test creates (``flag``), so the job is seen running however
slow the machine is, not for a fixed time. The tests that break the group end by restarting it.
"""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest
from notebook_accel.widgets import LaunchPanel

from notebook_accel.interactive import Job, JobRunningError, RankError, Ranks, current, start_ranks
from notebook_accel.interactive.magics import RanksMagic, RanksUsageError
from tests.launcher_helpers import wait_until

pytestmark = pytest.mark.timeout(180)

WAIT = "import os, time\nwhile not os.path.exists(flag): time.sleep(0.02)\n"
REFUSED = r"job \d+ \('import os, time …' on every rank, started \d+ s ago\) is running on the ranks in the background.*refused, not queued.*%ranks wait.*job.stop\(\)"


@pytest.fixture(scope="module")
def _group():
    ranks = start_ranks(2, hang_timeout=60)
    yield ranks
    ranks.stop()


@pytest.fixture
def ranks(_group: Ranks, tmp_path) -> Ranks:  # noqa: ANN001
    if not _group.alive:  # a test before broke it
        _group.restart()
    assert current() is _group
    _group.push("flag", str(tmp_path / "release"))
    return _group


def test_submit_returns_at_once_and_other_commands_are_refused_while_it_runs(ranks: Ranks, tmp_path) -> None:  # noqa: ANN001
    job = ranks.submit(WAIT + "rank * 10")
    assert isinstance(job, Job) and ranks.jobs[-1] is job
    try:
        assert not job.done() and job.state == "running"  # the job waits for the flag: submit did not
        wait_until(lambda: [s.state for s in ranks.status()] == ["running", "running"])
        # Every other command is refused (not queued), naming the job and the way out.
        with pytest.raises(JobRunningError, match=REFUSED):
            ranks.run("1")
        with pytest.raises(JobRunningError, match=REFUSED):
            ranks.execute("1", on=0)
        with pytest.raises(JobRunningError, match=REFUSED):
            ranks.push("x", 1)
        with pytest.raises(JobRunningError, match=REFUSED):
            ranks.pull("flag")
        with pytest.raises(JobRunningError, match=REFUSED):
            ranks.submit("2")
        with pytest.raises(
            TimeoutError, match=r"job \d+ \('import os, time …'\) is still running after 0.1 s"
        ):
            job.result(timeout=0.1)
        assert job.wait(0.05) is False
        assert f"job {job.number} running" in job.line() and "(every rank)" in job.line()
        assert repr(job).startswith(f"<Job {job.number} running")
    finally:
        (tmp_path / "release").write_text("go")
    assert job.result(timeout=60) == [0, 10]
    assert job.done() and job.state == "done" and job.elapsed > 0
    assert ranks.run("rank + 1") == [1, 2]  # the ranks take commands again


def test_submit_a_function_on_some_ranks(ranks: Ranks) -> None:
    def scaled(x: int, *, by: int) -> int:
        import torch.distributed as dist

        return (dist.get_rank() + x) * by

    job = ranks.submit(scaled, 1, by=3, on=[1])
    assert job.on == [1] and job.what == "test_submit_a_function_on_some_ranks.<locals>.scaled"
    assert job.result(timeout=60) == [6]


def test_result_raises_the_rank_error_and_the_ranks_go_on(ranks: Ranks, capsys) -> None:  # noqa: ANN001
    job = ranks.submit("kept = rank + 5\n1 / (rank - 1)")
    with pytest.raises(RankError, match=r"rank 1 .*ZeroDivisionError.*namespaces intact") as info:
        job.result(timeout=60)
    assert not info.value.broken and job.state == "failed"
    # The same error again (what a foreground cell would have raised), and a line in the job's output.
    with pytest.raises(RankError, match="ZeroDivisionError"):
        job.result()
    assert f"[job {job.number}] failed after" in capsys.readouterr().out
    assert ranks.run("kept") == [5, 6]


def test_stop_interrupts_the_job_and_the_namespaces_survive(ranks: Ranks, capsys) -> None:  # noqa: ANN001
    job = ranks.submit(
        "import time\nkept = rank * 2\nprint('looping', flush=True)\nwhile True: time.sleep(0.05)"
    )
    wait_until(lambda: all(any("looping" in line.text for line in ranks.handle.lines(r)) for r in (0, 1)))
    job.stop()
    assert job.done() and job.state == "stopped"
    with pytest.raises(KeyboardInterrupt, match=r"interrupted rank\(s\) \[0, 1\]; the ranks are alive"):
        job.result()
    job.stop()  # once it ended: nothing to do
    assert ranks.alive and ranks.run("kept") == [0, 2]


@pytest.mark.parametrize(
    ("code", "error", "refused"),
    [
        pytest.param(
            "import torch, torch.distributed as dist\nif rank == 1:\n    raise KeyError('rank one broke')\n"
            "dist.all_reduce(torch.ones(1))",
            r"(?s)rank 0 in all_reduce.*rank one broke",
            "run",
            id="collective-failure-with-every-stack",
        ),
        pytest.param(
            "import os, time\nif rank == 1:\n    time.sleep(0.3)\n    os._exit(3)\ntime.sleep(30)",
            r"(?s)exited with code 3.*died.*restart",
            "submit",
            id="rank-dying",
        ),
    ],
)
def test_a_job_breaking_the_group_fails_as_in_the_foreground(
    ranks: Ranks, code: str, error: str, refused: str
) -> None:
    # The watches of Group.exchange (a collective failure, a rank's death) run in the job's thread as in a cell.
    job = ranks.submit(code)
    with pytest.raises(RankError, match=error) as info:
        job.result(timeout=120)
    assert info.value.broken and job.state == "failed" and ranks.broken
    with pytest.raises(RuntimeError, match=r"the ranks' group is broken .*ranks.restart\(\)"):
        getattr(ranks, refused)("1")
    ranks.restart()
    assert ranks.run("rank") == [0, 1]


def test_stopping_the_ranks_stops_their_job_first(ranks: Ranks) -> None:
    job = ranks.submit("import time\nwhile True: time.sleep(0.05)")
    wait_until(lambda: [s.state for s in ranks.status()] == ["running", "running"])
    ranks.stop()
    assert job.done() and job.state == "stopped" and not ranks.alive
    ranks.restart()


def test_bad_submit_arguments_raise_before_anything_runs(ranks: Ranks) -> None:
    with pytest.raises(TypeError, match="ranks.submit\\(\\) takes a string of code or a callable; got int"):
        ranks.submit(3)
    with pytest.raises(TypeError, match=r"ranks.submit\(code\) takes no arguments; pass a function"):
        ranks.submit("x", 1)
    with pytest.raises(ValueError, match=r"rank 5 does not exist; this group has ranks 0..1"):
        ranks.submit("x", on=5)
    assert not any(job.state == "running" for job in ranks.jobs)


def _magic() -> RanksMagic:
    return RanksMagic(SimpleNamespace(user_ns={}))


def test_bg_cell_magic_wait_and_jobs(ranks: Ranks, tmp_path) -> None:  # noqa: ANN001
    magic = _magic()
    job = magic.cell("--bg 1", WAIT + "rank * 10")
    assert isinstance(job, Job) and job.on == [1] and job.state == "running"
    try:
        with pytest.raises(JobRunningError, match=REFUSED.replace("every rank", r"rank\(s\) \[1\]")):
            magic.cell("", "1")
        table = magic.line("jobs")
        assert re.search(rf"^{job.number} +running +[\d.]+ s +1 +import os, time …$", repr(table), re.M), (
            table
        )
        assert "<td>running</td>" in table._repr_html_()
    finally:
        (tmp_path / "release").write_text("go")
    shown = magic.line("wait")
    assert repr(shown) == "[rank 1] 10" and shown.values == [10]
    assert magic.line(f"wait {job.number}").values == [10]
    assert re.search(rf"^{job.number} +done ", repr(magic.line("jobs")), re.M)
    # The rank list may come before --bg too; a trailing ; hides the value, as in the foreground.
    assert magic.cell("0 --bg", "rank + 7;").result(timeout=60).values == [7]
    assert magic.line("wait") is None
    failing = magic.cell("--bg", "1 / (rank - 1)")
    with pytest.raises(RankError, match="ZeroDivisionError"):
        magic.line("wait")
    assert failing.state == "failed"


def test_wait_and_bg_usage_errors(ranks: Ranks, monkeypatch) -> None:  # noqa: ANN001
    magic = _magic()
    ranks.submit("1").result(timeout=60)
    numbers = ", ".join(str(job.number) for job in ranks.jobs)
    with pytest.raises(
        RanksUsageError, match=rf"%ranks wait 9999: no job 9999 on these ranks; their jobs are {numbers} "
    ):
        magic.line("wait 9999")
    with pytest.raises(RanksUsageError, match=r"%ranks wait: unrecognized arguments: 2"):
        magic.line("wait 1 2")
    with pytest.raises(RanksUsageError, match=r"%%ranks takes the ranks to run the cell on.*got '--bgx'"):
        magic.cell("--bgx", "1")
    monkeypatch.setattr(ranks, "_jobs", [])
    with pytest.raises(RanksUsageError, match=r"ran no background job; start one with `%%ranks --bg`"):
        magic.line("wait")
    assert (
        repr(magic.line("jobs")) == "no background jobs yet: %%ranks --bg (or ranks.submit(...)) starts one"
    )
    assert magic.line("jobs")._repr_html_() is None


def test_the_panel_shows_the_job_running_then_done(ranks: Ranks, tmp_path) -> None:  # noqa: ANN001
    panel = LaunchPanel(ranks, interval=0.05)
    job = ranks.submit(WAIT + "rank")
    try:
        wait_until(lambda: panel.state == "running")
        assert panel.job_text() == job.line() and f"job {job.number} running" in panel.job_text()
        assert f"background job {job.number} running" in repr(panel)
        assert f"<b>background</b> <code>job {job.number} running" in panel._status_html()
    finally:
        (tmp_path / "release").write_text("go")
    job.result(timeout=60)
    wait_until(lambda: panel.state == "idle")
    assert f"job {job.number} done after" in panel.job_text()
    assert f"job {job.number} done after" in panel._status_html()
    panel.close()


def test_two_threads_submitting_at_once_start_one_job(ranks: Ranks, tmp_path) -> None:  # noqa: ANN001
    outcomes: list[object] = []
    barrier = threading.Barrier(2)

    def submit() -> None:
        barrier.wait()
        try:
            outcomes.append(ranks.submit(WAIT + "rank"))
        except JobRunningError as err:
            outcomes.append(err)

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    (tmp_path / "release").write_text("go")
    jobs = [o for o in outcomes if isinstance(o, Job)]
    assert len(jobs) == 1 and len(outcomes) == 2, outcomes
    assert jobs[0].result(timeout=60) == [0, 1]
