"""A prepared stateful loader's ``state_dict()`` is torchdata's, as 1.15's is: checkpoints resume both ways.

tests/data/loader_state_1_15.json (scripts/record_loader_state.py, run under the real 1.15 with
torchdata) holds, for 0 and 2 workers with and without dispatching, the ``state_dict()`` 1.15 returned
after 3 batches and the batches a fresh loader yielded after loading it. Ours returns the same keys and
values (plus ``_notebook_accel_*`` keys of its own, which torchdata and 1.15 skip), resumes 1.15's state
on the same batches, and (where the Accelerate interpreter is here) 1.15 resumes ours on them too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.script_loader import load_script

pytest.importorskip("torchdata")

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "tests" / "data" / "loader_state_1_15.json").read_text(encoding="utf-8"))
RECORDER = load_script("record_loader_state.py")
ACCELERATE_PYTHON = os.environ.get("ACCELERATE_PYTHON") or str(ROOT / ".venv-accelerate" / "bin" / "python")
# Drawn afresh by every run (torch's worker base seed): compared as present, not as equal.
_RANDOM = "_base_seed"


def _without_random(value):
    if isinstance(value, dict):
        return {k: ("<random>" if k == _RANDOM else _without_random(v)) for k, v in value.items()}
    return value


def test_record_is_1_15s():
    assert RECORD["accelerate_version"].startswith("1.15") and len(RECORD["cases"]) == 4


@pytest.fixture(scope="module")
def ours() -> dict:
    return RECORDER.run(sys.executable, "notebook_accel", env={"PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("case", sorted(RECORD["cases"]))
def test_state_dict_is_torchdatas_as_1_15s(case, ours):
    mine = {k: v for k, v in ours[case]["state"].items() if not k.startswith("_notebook_accel_")}
    assert _without_random(mine) == _without_random(RECORD["cases"][case]["state"])
    assert "_notebook_accel_iteration" in ours[case]["state"]
    assert ours[case]["resumed"] == RECORD["cases"][case]["resumed"]


def test_a_state_saved_by_1_15_resumes_here(tmp_path):
    states = tmp_path / "states.json"
    states.write_text(json.dumps({name: case["state"] for name, case in RECORD["cases"].items()}))
    got = RECORDER.run(sys.executable, "notebook_accel", str(states), env={"PYTHONPATH": str(ROOT)})
    assert got == {name: case["resumed"] for name, case in RECORD["cases"].items()}


@pytest.mark.skipif(not os.path.exists(ACCELERATE_PYTHON), reason="no Accelerate 1.15 interpreter here")
def test_a_state_saved_here_resumes_on_1_15(tmp_path, ours):
    states = tmp_path / "states.json"
    states.write_text(json.dumps({name: case["state"] for name, case in ours.items()}))
    got = RECORDER.run(ACCELERATE_PYTHON, "accelerate", str(states))
    assert got == {name: case["resumed"] for name, case in RECORD["cases"].items()}
