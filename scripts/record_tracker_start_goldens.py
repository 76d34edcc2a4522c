"""Record when Accelerate 1.15's trackers start (tests/tracker_start_programs.py), offline, as goldens.

Each program runs under the real Accelerate in a fresh folder of its own (a child process, offline);
the results go to ``tests/data/goldens/tracker_start.json``, which ``tests/test_trackers_real.py``
compares with notebook_accel's. The tracker libraries must be installed beside Accelerate 1.15.

    python scripts/record_tracker_start_goldens.py --python /path/to/accelerate-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "goldens" / "tracker_start.json"
sys.path.insert(0, str(ROOT))

from tests.tracker_start_programs import PROGRAMS, run_in_child  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python", required=True, help="the Python of a venv with accelerate 1.15 and the trackers"
    )
    args = parser.parse_args()
    version = subprocess.run([args.python, "-c", "import accelerate; print(accelerate.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    goldens = {"accelerate_version": version, "programs": {}}
    for name in PROGRAMS:
        with tempfile.TemporaryDirectory() as workdir:
            goldens["programs"][name] = run_in_child(args.python, "accelerate", name, workdir, str(ROOT))
        print(f"{name}: recorded")
    OUT.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
