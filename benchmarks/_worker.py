"""Subprocess plumbing shared by the benchmarks that time notebook_accel against Accelerate.

Each implementation runs in a fresh interpreter (``python -c <worker> <impl> ...``): torch on one
thread, ``_models`` importable, the measured names imported from ``accelerate`` or ``notebook_accel``
as ``argv[1]`` says, logging and warnings muted. The worker prints one ``RESULT<json>`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The interpreter that has Accelerate 1.15 installed: $ACCELERATE_PYTHON, else a venv named
# ``.venv-accelerate`` at the root of this checkout (benchmarks/README.md). Every benchmark reads it here.
ACCELERATE_PYTHON = os.environ.get("ACCELERATE_PYTHON") or os.path.join(
    ROOT, ".venv-accelerate", "bin", "python"
)

_PRELUDE = """\
import sys
sys.path.insert(0, {here!r})
import torch
torch.set_num_threads(1)
if sys.argv[1] == "accelerate":
    from accelerate{module} import {names}
else:
    sys.path.insert(0, {root!r})
    from notebook_accel{module} import {names}
import logging, warnings
logging.disable(logging.WARNING); warnings.simplefilter("ignore")
"""


class WorkerFailed(RuntimeError):
    """A benchmark worker exited non-zero; ``returncode`` and ``stderr`` say how."""

    def __init__(self, impl: str, returncode: int, stderr: str) -> None:
        super().__init__(f"{impl} benchmark failed:\n{stderr[-3000:]}")
        self.returncode = returncode
        self.stderr = stderr


def worker_source(module: str, names: str, body: str) -> str:
    """Return a worker's source: the prelude importing ``names`` from ``<package><module>``, then ``body``.

    ``module`` is ``""`` or a dotted suffix such as ``".utils"``; ``body`` is plain Python (not a
    format string) that reads its arguments from ``sys.argv[1:]`` and prints ``RESULT<json>``.
    """
    return _PRELUDE.format(here=HERE, root=ROOT, module=module, names=names) + body


def run_worker(python: str, code: str, impl: str, *args: str) -> dict:
    """Return the JSON a worker printed on its ``RESULT`` line; raise :class:`WorkerFailed` if it failed.

    CUDA is hidden from the worker: both implementations are measured on the CPU.
    """
    proc = subprocess.run(
        [python, "-c", code, impl, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    if proc.returncode != 0:
        raise WorkerFailed(impl, proc.returncode, proc.stderr)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the two options of a script that re-runs itself under Accelerate: ``--backend`` and ``--json``."""
    parser.add_argument("--backend", choices=["notebook_accel", "accelerate"], default="notebook_accel")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (used for the Accelerate run)"
    )


def run_script_as_accelerate(script: str, *args: str) -> dict:
    """Return the JSON ``script --backend accelerate --json *args`` printed under Accelerate's Python.

    For the benchmarks that re-run themselves with ``--backend accelerate``: ``{}`` when that
    Python is missing, or when the run failed (the last line of its stderr is printed).
    """
    if not os.path.exists(ACCELERATE_PYTHON):
        return {}
    cmd = [ACCELERATE_PYTHON, script, "--backend", "accelerate", "--json", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"(Accelerate run failed: {proc.stderr.strip().splitlines()[-1:]})")
        return {}
    return json.loads(proc.stdout.strip().splitlines()[-1])
