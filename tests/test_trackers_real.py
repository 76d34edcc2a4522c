"""Trackers with their real libraries, offline, write what Accelerate 1.15 writes for the same calls.

tests/tracker_programs.py holds the calls (``init_trackers`` with a config, three ``log`` calls with
scalars, a text and a dict of scalars, ``end_training``) and the readers that turn what each
library wrote into JSON; tests/data/goldens/trackers.json is what they read after 1.15 ran them
(scripts/record_tracker_goldens.py). A tracker whose library is not installed is skipped, naming the
package (``pip install notebook-accel[trackers]``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tracker_programs import PACKAGES, READERS, tracker_env

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "goldens" / "trackers.json").read_text(encoding="utf-8"))
RUN = (
    "import sys; sys.path.insert(0, {root!r}); import notebook_accel; "
    "from tests.tracker_programs import run_program; run_program(notebook_accel, {tracker!r}, {workdir!r})"
)


def _run_ours(tracker: str, workdir: Path) -> None:
    env = {**os.environ, **tracker_env(str(workdir))}
    code = RUN.format(root=str(ROOT), tracker=tracker, workdir=str(workdir))
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("tracker", sorted(PACKAGES))
def test_tracker_writes_what_1_15_writes(tracker, tmp_path, monkeypatch):
    package = PACKAGES[tracker]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {tracker} tracker needs `{package}` (pip install notebook-accel[trackers])")
    if tracker not in GOLDEN:
        pytest.skip(f"no 1.15 golden recorded for {tracker} (scripts/record_tracker_goldens.py)")
    _run_ours(tracker, tmp_path)
    for key, value in tracker_env(str(tmp_path)).items():
        monkeypatch.setenv(key, value)
    assert READERS[tracker](str(tmp_path)) == GOLDEN[tracker]["written"]


def test_goldens_come_from_1_15_and_cover_the_installed_trackers():
    assert all(entry["accelerate_version"].startswith("1.15") for entry in GOLDEN.values())
    assert {"tensorboard", "mlflow", "wandb", "comet_ml", "clearml"} <= set(GOLDEN)
