"""A transformers Trainer inside notebook_launcher (2 gloo processes): from a script and from a Jupyter kernel,
on notebook_accel (install_as_accelerate) and on the real accelerate driven by our launcher and LaunchPanel.

Every run trains the same tiny GPT-2 for 4 DDP steps; both ranks must end with identical weights that
moved away from the initial ones, and the real-accelerate run must train exactly as ours does.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.clients._launch_scenario import TRAIN_SOURCE
from tests.clients._subproc import ROOT, last_line, run_python

pytest.importorskip("transformers")
REAL_INSTALLED = importlib.util.find_spec("accelerate") is not None
SCENARIO = "from tests.clients._launch_scenario import main; main({mode!r})"


def _check_ranks(got: dict, accelerate_name: str) -> None:
    assert [r["rank"] for r in got["ranks"]] == [0, 1]
    assert all(r["world_size"] == 2 and r["accelerate"] == accelerate_name for r in got["ranks"])
    assert all(r["distributed"].endswith("MULTI_CPU") for r in got["ranks"])
    assert got["rank_weight_diff"] == 0.0
    assert got["ranks"][0]["moved"] > 1e-3


@pytest.fixture(scope="module")
def ours_from_script() -> dict:
    return json.loads(last_line(run_python(SCENARIO.format(mode="ours"))))


def test_trainer_in_launcher_from_a_script_on_notebook_accel(ours_from_script):
    _check_ranks(ours_from_script, "notebook_accel")
    assert ours_from_script["panel_state"] == "succeeded" and ours_from_script["panel_has_loss"]


@pytest.mark.skipif(
    not REAL_INSTALLED, reason="needs the real accelerate installed (the clients extra pulls it)"
)
def test_our_launcher_and_panel_drive_a_real_accelerate_trainer(ours_from_script):
    got = json.loads(last_line(run_python(SCENARIO.format(mode="real"))))
    _check_ranks(got, "accelerate")
    assert got["panel_state"] == "succeeded" and got["panel_rows"] == ["succeeded", "succeeded"]
    assert got["panel_has_loss"]  # the Trainer's log lines reached the panel
    assert got["ranks"][0]["moved"] == ours_from_script["ranks"][0]["moved"]  # the same training


@pytest.mark.timeout(280)
def test_trainer_in_launcher_from_a_jupyter_kernel(monkeypatch):
    pytest.importorskip("ipykernel")
    from tests.test_launcher_kernel import Kernel

    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    kernel = Kernel()
    try:
        status, _, err, _ = kernel.run(
            f"""
            import sys, warnings
            sys.path.insert(0, {str(ROOT)!r})
            warnings.simplefilter("ignore")
            import notebook_accel
            notebook_accel.install_as_accelerate()
            """
        )
        assert status == "ok", err
        status, _, err, _ = kernel.run(TRAIN_SOURCE)  # the function is defined in a cell
        assert status == "ok", err
        status, out, err, _ = kernel.run(
            """
            import json
            from tests.clients._launch_scenario import summarize
            results = notebook_accel.notebook_launcher(train_ranks, num_processes=2)
            print("RESULT", json.dumps(summarize(results)))
            """,
            timeout=240,
        )
        assert status == "ok", err
        got = json.loads(
            next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :]
        )
        _check_ranks(got, "notebook_accel")
        assert "[rank 1] rank 1 trained 4 steps" in out  # per-rank output streamed into the cell
    finally:
        kernel.close()
    assert os.environ.get("NOTEBOOK_ACCEL_AS_ACCELERATE") is None  # the alias stayed in the kernel
