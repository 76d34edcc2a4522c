"""Utilities and big-model behaviours give what Accelerate 1.15 gives (tests/data/goldens/bigmodel.json).

The cases are in tests/goldens_bigmodel_cases.py (recorded under 1.15 by scripts/record_bigmodel_goldens.py);
each runs here on notebook_accel, in this process, and is compared whole. Messages are compared on their first
line: ours may add the way out on the next. The differences kept on purpose are in docs/guide/migrating.md
and are not among the cases (1.15's warning about device-map keys naming parameters, slices it drops on save).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import notebook_accel
from tests.goldens_bigmodel_cases import CASES

GOLDEN = json.loads(
    (Path(__file__).parent / "data" / "goldens" / "bigmodel.json").read_text(encoding="utf-8")
)


def test_goldens_come_from_1_15_and_cover_every_case() -> None:
    assert GOLDEN["accelerate_version"].startswith("1.15")
    assert set(GOLDEN["cases"]) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_matches_1_15(name) -> None:
    ours = json.loads(json.dumps(CASES[name](notebook_accel)))  # tuples -> lists, as recorded
    expected = GOLDEN["cases"][name]
    if isinstance(expected, dict):
        differing = sorted(key for key in expected if ours.get(key) != expected[key])
        assert not differing, {key: {"1.15": expected[key], "ours": ours.get(key)} for key in differing}
    assert ours == expected
