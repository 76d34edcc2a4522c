"""Record what Accelerate 1.15's trackers write with their real libraries (offline), as goldens.

For each tracker of ``tests/tracker_programs.py`` whose library is installed, run its program under
the real Accelerate in a fresh folder and save what the library wrote, read back into JSON, in
``tests/data/goldens/trackers.json``. ``tests/test_trackers_real.py`` runs the same program under
notebook_accel and compares.

    python scripts/record_tracker_goldens.py --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "goldens" / "trackers.json"


def worker(tracker: str, workdir: str) -> None:
    """Run one tracker's program under the real Accelerate and print what it wrote, as JSON."""
    import warnings

    import accelerate

    warnings.simplefilter("ignore")
    sys.path.insert(0, str(ROOT))
    from tests.tracker_programs import READERS, run_program

    run_program(accelerate, tracker, workdir)
    print(json.dumps({"written": READERS[tracker](workdir), "accelerate_version": accelerate.__version__}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="interpreter with accelerate==1.15 and the trackers")
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(*ns.worker)
        return
    sys.path.insert(0, str(ROOT))
    from tests.tracker_programs import PACKAGES, tracker_env

    out: dict = {}
    for tracker, package in PACKAGES.items():
        if importlib.util.find_spec(package) is None:
            print(f"skipping {tracker}: `{package}` is not installed")
            continue
        with tempfile.TemporaryDirectory() as workdir:
            env = {**os.environ, **tracker_env(workdir)}
            proc = subprocess.run([os.path.abspath(ns.python), __file__, "--python", ns.python, "--worker", tracker,
                                   workdir], cwd=workdir, env=env, capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"{tracker} under 1.15 failed:\n{proc.stderr[-3000:]}")
            out[tracker] = json.loads(proc.stdout.strip().splitlines()[-1])
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: {sorted(out)}")


if __name__ == "__main__":
    main()
