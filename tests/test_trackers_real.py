"""Trackers with their real libraries, offline, write what Accelerate 1.15 writes for the same calls.

tests/tracker_programs.py holds the calls (``init_trackers`` with a config, three ``log`` calls with
scalars, a text and a dict of scalars, ``end_training``) and the readers that turn what each
library wrote into JSON; tests/data/goldens/trackers.json is what they read after 1.15 ran them
(scripts/record_tracker_goldens.py), with the ``log`` calls that raised (Aim refuses a string and a
dict, as its library does under 1.15). A tracker whose library is not installed is skipped, naming the
package (``pip install notebook-accel[trackers]``). Every run is offline: the libraries' offline switches
(``tracker_env``) and, in the process, ``network_guards`` refusing any address beyond the loopback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tracker_programs import PACKAGES, READERS, go_offline, read_errors, tracker_env

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "goldens" / "trackers.json").read_text(encoding="utf-8"))
# The refused connections are printed at exit, after the libraries' own exit handlers (registered later).
RUN = (
    "import atexit, json, sys; sys.path.insert(0, {root!r}); import notebook_accel; "
    "from tests.tracker_programs import network_guards, run_program; refused = []; "
    "[setattr(owner, name, value) for owner, name, value in network_guards(refused)]; "
    "atexit.register(lambda: print(json.dumps(refused))); "
    "run_program(notebook_accel, {tracker!r}, {workdir!r})"
)


def _run_ours(tracker: str, workdir: Path) -> None:
    # without pytest's own variable, which MLflow takes as "no telemetry": the switches must do that
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, **tracker_env(str(workdir))}
    code = RUN.format(root=str(ROOT), tracker=tracker, workdir=str(workdir))
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", f"went to the network: {proc.stdout[-500:]}"


@pytest.mark.parametrize("tracker", sorted(PACKAGES))
def test_tracker_writes_what_1_15_writes(tracker, tmp_path, monkeypatch):
    package = PACKAGES[tracker]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {tracker} tracker needs `{package}` (pip install notebook-accel[trackers])")
    if tracker not in GOLDEN:
        pytest.skip(f"no 1.15 golden recorded for {tracker} (scripts/record_tracker_goldens.py)")
    _run_ours(tracker, tmp_path)
    refused = go_offline(monkeypatch, str(tmp_path))  # the readers use the libraries too
    assert READERS[tracker](str(tmp_path)) == GOLDEN[tracker]["written"]
    assert read_errors(str(tmp_path)) == GOLDEN[tracker].get("errors", [])
    assert refused == []


def test_goldens_come_from_1_15_and_cover_the_installed_trackers():
    assert all(entry["accelerate_version"].startswith("1.15") for entry in GOLDEN.values())
    assert {"tensorboard", "mlflow", "wandb", "comet_ml", "clearml", "aim", "dvclive"} <= set(GOLDEN)
    assert set(GOLDEN) == set(PACKAGES) == set(READERS)


def test_dvclive_warns_about_a_value_it_cannot_log_and_logs_the_rest(tmp_path, monkeypatch, caplog):
    if importlib.util.find_spec("dvclive") is None:
        pytest.skip("the dvclive tracker needs `dvclive` (pip install notebook-accel[trackers])")
    from notebook_accel.tracking import DVCLiveTracker

    refused = go_offline(monkeypatch, str(tmp_path))
    tracker = DVCLiveTracker("run")
    tracker.start()
    with caplog.at_level("WARNING", logger="notebook_accel.tracking.services"):
        tracker.log({"per_class": {"a": 0.5}, "note": "ok", "loss": 1.5}, step=4)
    tracker.finish()
    assert "'per_class' is a dict, which DVCLive cannot log" in caplog.text
    metrics = json.loads((tmp_path / "dvclive" / "metrics.json").read_text())
    assert metrics == {"note": "ok", "loss": 1.5, "step": 4} and refused == []


START_GOLDEN = json.loads(
    (ROOT / "tests" / "data" / "goldens" / "tracker_start.json").read_text(encoding="utf-8")
)


@pytest.mark.parametrize("program", sorted(START_GOLDEN["programs"]))
def test_trackers_start_when_1_15_starts_them(program, tmp_path):
    """Building a tracker does no run work; TensorBoard/Aim without a dir, DVCLive's steps, ClearML's close: 1.15's."""
    from tests.tracker_start_programs import NEEDS, PACKAGES, run_in_child

    missing = [p for p in NEEDS[program] if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{program} needs {missing} (pip install notebook-accel[trackers])")
    ours = run_in_child(sys.executable, "notebook_accel", program, str(tmp_path), str(ROOT))
    expected = START_GOLDEN["programs"][program]
    if program == "build_without_start":  # compared for the libraries installed here
        expected = {cls: fact for cls, fact in expected.items() if importlib.util.find_spec(PACKAGES[cls])}
    assert START_GOLDEN["accelerate_version"].startswith("1.15")
    assert ours == expected


def test_aim_takes_its_repository_from_a_repo_keyword(tmp_path, monkeypatch):
    """``AimTracker(..., repo=...)``: the keyword names the repository (1.15 raises Run()'s duplicate 'repo')."""
    if importlib.util.find_spec("aim") is None:
        pytest.skip("the aim tracker needs `aim` (pip install notebook-accel[trackers])")
    from notebook_accel.tracking import AimTracker

    refused = go_offline(monkeypatch, str(tmp_path))
    tracker = AimTracker(
        "named", str(tmp_path / "ignored"), repo=str(tmp_path / "chosen"), capture_terminal_logs=False
    )
    assert tracker.tracker is None and not (tmp_path / "chosen").exists()
    tracker.start()
    tracker.log({"loss": 0.5}, step=1)
    assert os.path.realpath(tracker.tracker.repo.path) == os.path.realpath(tmp_path / "chosen" / ".aim")
    assert tracker.tracker.name == "named"
    tracker.finish()
    assert refused == [] and not (tmp_path / "ignored").exists()


CLEARML_CHILD = """
import json, os, sys
os.environ["CLEARML_CACHE_DIR"] = sys.argv[1]
from clearml import Task
from clearml.config import get_offline_dir
from notebook_accel.tracking import ClearMLTracker
Task.set_offline(True)
tracker = ClearMLTracker("table_run")
tracker.start()
task_id = tracker.task.id
tracker.log_table("from lists", columns=["A", "B"], data=[[1, 2], [3, 4]])
tracker.finish()
with open(os.path.join(get_offline_dir(task_id=task_id), "task.json")) as f:
    print(json.dumps(json.load(f)["script"]))
"""


def test_clearml_task_records_the_users_script_and_the_process_exits(tmp_path):
    """Run as ``python -m`` (as pytest is), ClearML's task names the user's module, not our checkout.

    ``Task.init`` takes its caller's file as the script; called from notebook_accel's own module,
    ClearML ran git over notebook_accel's checkout (its branch, commit and diff stored as the user's
    script), and ``finish()``'s ``task.close()`` waited for that analysis, up to its 5-minute limit.
    The child must log a table, close and exit within the timeout.
    """
    if importlib.util.find_spec("clearml") is None:
        pytest.skip("the clearml tracker needs `clearml` (pip install notebook-accel[trackers])")
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "train.py").write_text(CLEARML_CHILD, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "userpkg.train", str(tmp_path / "cache")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    script = json.loads(done.stdout.strip().splitlines()[-1])
    assert script.get("version_num", "") == "" and script.get("branch", "") == ""  # no git of our checkout
    assert "diff --git" not in script["diff"]
    assert "log_table" in script["diff"]  # the user's module, stored as a standalone script
