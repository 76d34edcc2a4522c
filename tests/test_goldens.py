"""Differential tests: notebook_accel gives the numbers Accelerate 1.15 gives on the same programs.

The programs live in ``tests/goldens_programs.py``; Accelerate's results were recorded with
``scripts/record_accelerate_goldens.py`` (torchrun, gloo, CPU) into ``tests/data/goldens/``. Here
the same programs run on notebook_accel: all cases in one ``notebook_launcher`` launch of 2 processes
(and once in this process, ``num_processes=1``), then each case is compared on its own: sample
indices, step flags and counts identical, floats (losses, parameters, learning rates) within 1e-6.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import notebook_accel
import notebook_accel.state  # noqa: F401  (the programs reach A.state and A.utils)
import notebook_accel.utils  # noqa: F401
from notebook_accel import notebook_launcher
from tests.goldens_programs import CASES, run_cases

GOLDENS = Path(__file__).parent / "data" / "goldens"
TOLERANCE = 1e-6


def _load(world: int) -> dict[str, list[dict]]:
    return json.loads((GOLDENS / f"world{world}.json").read_text())["cases"]


def _run_all(workdir: str) -> dict[str, Any]:
    """Run every case on notebook_accel in this process; a failing case is recorded, not raised."""
    return run_cases(notebook_accel, workdir, catch=True)


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    """Return ``{world: {case: [rank results]}}`` from one launch per world size."""
    # block=False runs even one rank in a worker process of its own, in a group of one: the
    # environment torchrun gave Accelerate when the goldens were recorded (and this process's RNG
    # and singletons stay untouched).
    handles = {
        world: notebook_launcher(
            _run_all,
            args=(str(tmp_path_factory.mktemp(f"goldens{world}")),),
            num_processes=world,
            sinks=[],
            timeout=300,
            block=False,
        )  # fmt: skip
        for world in (1, 2)
    }
    out = {}
    for world, handle in handles.items():
        per_rank = handle.result()
        out[world] = {name: [rank[name] for rank in per_rank] for name in per_rank[0]}
    return out


def _compare(path: str, expected: Any, actual: Any, problems: list[str]) -> None:
    """Append to ``problems`` every place where ``actual`` differs from ``expected``."""
    if len(problems) > 10:
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(expected) != set(actual):
            problems.append(
                f"{path}: keys {sorted(expected)} != {sorted(actual) if isinstance(actual, dict) else actual!r}"
            )
            return
        for key in expected:
            _compare(f"{path}.{key}", expected[key], actual[key], problems)
    elif isinstance(expected, list):
        if not isinstance(actual, list) or len(expected) != len(actual):
            problems.append(f"{path}: expected {_short(expected)}, got {_short(actual)}")
            return
        if all(isinstance(v, (int, str, bool)) for v in expected):
            if expected != actual:  # a list of indices or flags: report it whole
                problems.append(f"{path}: expected {_short(expected)}, got {_short(actual)}")
            return
        for i, (e, a) in enumerate(zip(expected, actual)):
            _compare(f"{path}[{i}]", e, a, problems)
    elif isinstance(expected, float) and not isinstance(actual, bool) and isinstance(actual, (int, float)):
        if not math.isclose(expected, actual, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
            problems.append(f"{path}: expected {expected!r}, got {actual!r}")
    elif type(expected) is not type(actual) or expected != actual:
        problems.append(f"{path}: expected {expected!r}, got {actual!r}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:300] + "..."


def differences(expected: Any, actual: Any) -> list[str]:
    """Return the places (at most about ten) where ``actual`` differs from ``expected``."""
    problems: list[str] = []
    _compare("result", expected, actual, problems)
    return problems


# Cases that need a package of the `test` extra beyond the core (installed in CI; skipped where missing).
NEEDS = {"dropin_stateful_state_dict_resume": "torchdata", "loader_native_shards": "datasets"}


@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_accelerate(ours, world: int, case: str) -> None:
    if case in NEEDS:
        pytest.importorskip(NEEDS[case])
    expected = _load(world)[case]
    actual = ours[world][case]
    for rank, result in enumerate(actual):
        if isinstance(result, dict) and "error" in result:
            pytest.fail(f"rank {rank} raised:\n{result['error']}")
    problems = differences(expected, actual)
    assert not problems, f"{case} on {world} process(es) differs from Accelerate 1.15:\n" + "\n".join(
        problems
    )


def test_matrix_covers_the_issue() -> None:
    # The issue asks for at least 40 cases; every recorded case is run and every program recorded.
    assert len(CASES) >= 40
    for world in (1, 2):
        assert set(_load(world)) == set(CASES), f"world{world}.json is stale: rerun the recording script"


def test_issue_regression_same_model_on_one_and_two_processes(ours) -> None:
    # The issue's example: a shuffled loader with a user generator trains the same model on one
    # process (batch 16) and on two (8 each, or 16 split), as with Accelerate.
    for case in ("shuffle_user_generator", "shuffle_user_generator_split_batches"):
        one, two = ours[1][case][0]["params"], ours[2][case]
        assert two[0]["params"] == two[1]["params"]
        assert differences(one, two[0]["params"]) == [], case


def test_differences_reports_mismatch() -> None:
    assert differences({"a": [1, 2], "p": [1.0]}, {"a": [1, 2], "p": [1.0 + 5e-7]}) == []
    assert differences({"a": [1, 2]}, {"a": [2, 1]}) == ["result.a: expected [1, 2], got [2, 1]"]
    assert differences({"p": [1.0]}, {"p": [1.0 + 1e-5]})
    assert differences({"a": True}, {"a": 1})
