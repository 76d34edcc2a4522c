"""Run a test body in a fresh interpreter, so `install_as_accelerate()` never leaks into other tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(
    code: str, *, timeout: float = 280, cwd: str | os.PathLike | None = None, env: dict | None = None
) -> str:
    """Return the stdout of ``python -c code`` (offline, CPU); fail the test with its output if it exits non-zero."""
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    full_env.pop("NOTEBOOK_ACCEL_AS_ACCELERATE", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=full_env,
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}")
    return proc.stdout


def last_line(out: str) -> str:
    """Return the last non-empty line of ``out`` (where the test bodies print their verdict)."""
    return [line for line in out.splitlines() if line.strip()][-1]
