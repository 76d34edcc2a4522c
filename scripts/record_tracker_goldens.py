"""Record what Accelerate 1.15's trackers write with their real libraries (offline), as goldens.

For each tracker of ``tests/tracker_programs.py`` whose library is installed, run its program under
the real Accelerate in a fresh folder and save what the library wrote, read back into JSON, in
``tests/data/goldens/trackers.json``, with the ``log`` calls that raised (``errors``, when any did).
``tests/test_trackers_real.py`` runs the same program under notebook_accel and compares.

    python scripts/record_tracker_goldens.py --python .venv/bin/python
    python scripts/record_tracker_goldens.py --python .venv/bin/python --only aim dvclive  # keep the others
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
    from tests.tracker_programs import READERS, network_guards, read_errors, run_program

    refused: list = []
    for owner, attribute, replacement in network_guards(refused):
        setattr(owner, attribute, replacement)
    run_program(accelerate, tracker, workdir)
    entry = {"written": READERS[tracker](workdir), "accelerate_version": accelerate.__version__}
    if read_errors(workdir):
        entry["errors"] = read_errors(workdir)
    if refused:
        raise SystemExit(f"{tracker} under 1.15 went to the network: {refused}")
    print(json.dumps(entry))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="interpreter with accelerate==1.15 and the trackers")
    parser.add_argument(
        "--only", nargs="+", default=None, help="record these trackers, keep the other goldens"
    )
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(*ns.worker)
        return
    sys.path.insert(0, str(ROOT))
    from tests.tracker_programs import PACKAGES, tracker_env

    unknown = sorted(set(ns.only or ()) - set(PACKAGES))
    if unknown:
        raise SystemExit(
            f"--only {unknown}: not a tracker of tests/tracker_programs.py; choose from {sorted(PACKAGES)}"
        )
    out: dict = json.loads(OUT.read_text()) if ns.only and OUT.exists() else {}
    for tracker, package in PACKAGES.items():
        if ns.only and tracker not in ns.only:
            continue
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
