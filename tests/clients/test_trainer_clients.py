"""transformers' Trainer on the CPU running on notebook_accel (after install_as_accelerate).

One fresh interpreter runs tests/clients/_trainer_scenarios.py (a tiny GPT-2 from a config, a
synthetic next-token dataset) and reports JSON; each test checks one scenario. The same scenarios on
the real accelerate (installed by the clients extra) give the reference numbers, compared exactly.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.clients._subproc import last_line, run_python

pytest.importorskip("transformers")
REAL_INSTALLED = importlib.util.find_spec("accelerate") is not None
SCENARIO = "from tests.clients._trainer_scenarios import main; main({mode!r})"


@pytest.fixture(scope="module")
def ours() -> dict:
    return json.loads(last_line(run_python(SCENARIO.format(mode="ours"))))


def _ok(results: dict, name: str) -> dict:
    got = results[name]
    assert "error" not in got, got.get("error")
    return got


def test_loss_falls(ours):
    assert ours["accelerate"] == "notebook_accel"
    got = _ok(ours, "loss_falls")
    assert got["steps"] == 20 and got["last"] < got["first"] - 0.3


def test_gradient_accumulation_2x4_equals_batch_8(ours):
    got = _ok(ours, "accumulation")
    assert got["moved"] > 1e-3  # training changed the weights, so equality means something
    assert got["max_diff"] < 1e-5


def test_resume_from_checkpoint_continues_at_the_right_step(ours):
    got = _ok(ours, "resume")
    assert got["global_step"] == 6 and got["steps_run_after_resume"] == [4, 5, 6]
    assert got["max_diff_vs_straight"] < 1e-6
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors"} <= set(
        got["checkpoint_files"]
    )


def test_evaluate_and_predict(ours):
    got = _ok(ours, "evaluate_predict")
    assert got["pred_shape"] == [8, 12, 96] and got["pred_max_diff"] < 1e-6
    assert got["eval_loss"] == pytest.approx(got["predict_loss"])


def test_auto_find_batch_size_shrinks_on_out_of_memory(ours):
    got = _ok(ours, "auto_batch")
    # Accelerate 1.15 multiplies the batch size by 0.9 (rounded down) after each out-of-memory error.
    assert got["tried"] == [16, 14, 12, 10, 9, 8, 7, 6, 5, 4] and got["final"] == 4 and got["steps"] == 2


@pytest.mark.skipif(
    not REAL_INSTALLED, reason="needs the real accelerate installed (the clients extra pulls it)"
)
def test_numbers_match_the_real_accelerate(ours):
    real = json.loads(last_line(run_python(SCENARIO.format(mode="real"))))
    assert real["accelerate"] == "accelerate"
    for name in ("loss_falls", "evaluate_predict", "auto_batch"):
        assert _ok(real, name) == _ok(ours, name), name
    assert _ok(ours, "accumulation")["max_diff"] == pytest.approx(
        _ok(real, "accumulation")["max_diff"], abs=1e-6
    )
