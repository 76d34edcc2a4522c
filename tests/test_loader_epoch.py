"""``set_epoch(n)`` on a prepared DataLoader reaches a user's own batch sampler, in one process and in two.

tests/data/loader_set_epoch_1_15.json (scripts/record_loader_epoch.py, run under the real 1.15) holds
which samplers 1.15's ``set_epoch(3)`` reached: in one process, the user's batch sampler (unless the
batches are dispatched) and the sampler inside it. In two processes 1.15 reaches only the sampler; ours
reaches the user's batch sampler there too, as in one process (docs/guide/migrating.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "tests" / "data" / "loader_set_epoch_1_15.json").read_text(encoding="utf-8"))
RECORDER = load_script("record_loader_epoch.py")
ENV = {"PYTHONPATH": str(ROOT)}


def test_record_is_1_15s():
    assert RECORD["accelerate_version"].startswith("1.15") and len(RECORD["one_process"][0]) == 12


def test_one_process_reaches_what_1_15_reaches():
    (ours,) = RECORDER.run(sys.executable, "notebook_accel", 1, ENV)
    assert ours == RECORD["one_process"][0]
    assert ours["batch_sampler_only/dispatch=False"]["batch_sampler"] == 3


def test_two_processes_reach_the_users_batch_sampler_too():
    ranks = RECORDER.run(sys.executable, "notebook_accel", 2, ENV)
    for ours, theirs in zip(ranks, RECORD["two_processes"]):
        for case, reached in theirs.items():
            # the one difference: without dispatching, ours reaches the batch sampler as in one process
            expected = RECORD["one_process"][0][case] if "dispatch=False" in case else reached
            assert ours[case] == expected, case
    assert all(r["plain_batches/dispatch=False"]["batch_sampler"] == 3 for r in ranks)
