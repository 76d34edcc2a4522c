"""The benchmarks find Accelerate's interpreter in one place: ``$ACCELERATE_PYTHON``, else the checkout's venv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _accelerate_python(env: dict[str, str]) -> str:
    code = "import _worker; print(_worker.ACCELERATE_PYTHON)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks", env=env, capture_output=True,
                         text=True, check=True, timeout=120)  # fmt: skip
    return out.stdout.strip()


def test_the_environment_variable_names_accelerates_python():
    env = {**os.environ, "ACCELERATE_PYTHON": "/opt/elsewhere/bin/python"}
    assert _accelerate_python(env) == "/opt/elsewhere/bin/python"


def test_without_it_the_checkouts_own_venv_is_used():
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_PYTHON"}
    assert _accelerate_python(env) == str(ROOT / ".venv-accelerate" / "bin" / "python")


def test_no_benchmark_names_one_machines_accelerate_venv():
    for path in (ROOT / "benchmarks").glob("*.py"):
        assert "/.venv-accelerate" not in path.read_text(encoding="utf-8"), path.name
