"""Record Accelerate 1.15's utilities and big-model behaviours (tests/goldens_bigmodel_cases.py) as goldens.

Run with the Python of a venv holding accelerate 1.15 (no launch: one process, CPU):

    /path/to/accelerate-venv/bin/python scripts/record_bigmodel_goldens.py

It writes ``tests/data/goldens/bigmodel.json``, which ``tests/test_goldens_bigmodel.py`` compares with ours.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import accelerate  # noqa: E402

from tests.goldens_bigmodel_cases import CASES  # noqa: E402


def main() -> None:
    goldens = {"accelerate_version": accelerate.__version__, "cases": {}}
    for name, case in CASES.items():
        goldens["cases"][name] = case(accelerate)
        print(f"{name}: recorded")
    out = ROOT / "tests" / "data" / "goldens" / "bigmodel.json"
    out.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
