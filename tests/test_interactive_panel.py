"""The launch panel of interactive ranks: a real 2-rank gloo group (start_ranks) seen between and during cells."""

from __future__ import annotations

import threading

import pytest
from notebook_accel.widgets import LaunchPanel

from notebook_accel.interactive import RankError, Ranks, start_ranks
from tests.launcher_helpers import wait_until

pytestmark = pytest.mark.timeout(180)

# One line (the panel shows it whole as the cell), running until the test creates the file ``flag``
# names: the cell is seen running however slow the machine, not for a fixed time.
WAIT = "while not os.path.exists(flag): time.sleep(0.05)"


@pytest.fixture(scope="module")
def ranks():
    group = start_ranks(2, hang_timeout=60)
    yield group
    group.stop()


def _states(panel: LaunchPanel) -> list[tuple[str, str]]:
    return [(row["state"], row["cell"]) for row in panel.rows()]


def test_panel_shows_each_rank_idle_running_its_cell_then_idle(ranks: Ranks, tmp_path) -> None:  # noqa: ANN001
    flag = tmp_path / "release"
    ranks.run("import os, time")
    ranks.push("flag", str(flag))
    panel = LaunchPanel(ranks, interval=0.05)
    assert panel.handle is ranks.handle and panel.ranks_object is ranks
    assert panel.widget is not None
    wait_until(lambda: panel.state == "idle")
    assert [state for state, _ in _states(panel)] == ["idle", "idle"]
    wait_until(lambda: ">cell</th>" in panel._w_status.value and panel._w_state.description == "idle")
    assert panel._w_stop.tooltip == "stop the ranks"

    done = threading.Event()
    worker = threading.Thread(target=lambda: (ranks.run(WAIT), done.set()), daemon=True)
    worker.start()
    try:
        # Each rank's row: "running" and the cell it runs; the view follows without any output line.
        wait_until(
            lambda: (
                _states(panel) == [("running", WAIT), ("running", WAIT)]
                and "running" in panel._w_status.value
            )
        )
        wait_until(lambda: panel._w_state.description == "running")
        assert panel.state == "running" and WAIT in panel._w_status.value
        assert "LaunchPanel(running)" in repr(panel) and WAIT in repr(panel)
        # The Stacks button while the cell runs: each rank's frame in the cell, with the cell's line.
        panel._w_stacks_button.click()
        for stack in panel.stacks.values():
            assert "<rank cell" in stack.text and f"    {WAIT}" in stack.text, stack.text
        assert panel._w_stacks.value.count(f"    {WAIT}") == 2
    finally:
        flag.write_text("done")  # the cell ends
    worker.join(60)
    assert done.is_set()
    wait_until(lambda: _states(panel) == [("idle", WAIT), ("idle", WAIT)])
    wait_until(lambda: panel._w_state.description == "idle" and "running" not in panel._w_status.value)

    # A cell raising on rank 1: that rank reads "failed", the other stays idle; the ranks are alive.
    with pytest.raises(RankError, match="ZeroDivisionError"):
        ranks.run("1 / (rank - 1)")
    wait_until(lambda: [state for state, _ in _states(panel)] == ["idle", "failed"])
    assert panel.state == "idle"
    wait_until(lambda: "failed" in panel._w_status.value)
    panel.close()


def test_panel_of_the_ranks_handle_finds_the_current_ranks(ranks: Ranks) -> None:
    # start_ranks(..., panel=True) builds its panel from the handle alone, while the ranks start.
    panel = LaunchPanel(ranks.handle, interval=0.05)
    assert panel.ranks_object is ranks
    wait_until(lambda: panel.state == "idle")
    assert [row["cell"] is not None for row in panel.rows()] == [True, True]
    panel.close()


def test_bad_ranks_arguments_raise(ranks: Ranks) -> None:
    with pytest.raises(ValueError, match=r"were never started: start them with start_ranks"):
        LaunchPanel(Ranks(2))
    with pytest.raises(ValueError, match=r"ranks= are not the ranks of this handle; pass ranks.handle"):
        LaunchPanel(object(), ranks=ranks)
    with pytest.raises(TypeError, match=r"ranks= takes interactive ranks \(start_ranks\(...\)\); got int"):
        LaunchPanel(ranks.handle, ranks=3)


def test_a_dead_rank_restart_and_stop_show_in_the_panel(ranks: Ranks) -> None:
    old = LaunchPanel(ranks, interval=0.05)
    assert old.widget is not None
    with pytest.raises(RankError, match="exited with code 3"):
        ranks.run("if rank == 1:\n    import os\n    os._exit(3)")
    # A rank died: the group is broken (restart() recovers), and the panel says so with the root cause.
    wait_until(lambda: old.state == "broken" and old._w_stop.disabled)
    assert old._w_state.description == "broken" and old._w_state.button_style == "danger"
    assert "rank 1" in old.error_text() and "rank 1" in old._w_error.value
    ranks.restart()
    # The old panel's ranks were replaced: stopped; a new panel shows the new ones.
    wait_until(lambda: old.state == "stopped")
    new = LaunchPanel(ranks, interval=0.05)
    assert new.widget is not None
    wait_until(lambda: new.state == "idle")
    new._w_stop.click()  # ranks.stop()
    assert not ranks.alive
    wait_until(lambda: new.state == "stopped" and new._w_stop.disabled)
    assert [row["state"] for row in new.rows()] == ["stopped", "stopped"]
    old.close()
    new.close()
