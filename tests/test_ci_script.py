"""What .ci/run promises: its last command is the README's test command, and the core subset it runs on
Python 3.10 and 3.13 names test files that exist, installs with an extra that exists, in git-ignored venvs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # 3.11+: the main suite's Python

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()


def _readme_commands() -> list[str]:
    return [
        line.strip()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("    python3 ")
    ]


def test_the_last_command_of_ci_is_the_readme_test_command() -> None:
    last = [line for line in CI.splitlines() if line.strip()][-1]
    assert last == _readme_commands()[1]


def test_the_core_subset_names_existing_test_files_and_pythons() -> None:
    block = re.search(r'CORE_TESTS="([^"]+)"', CI)
    assert block, "CORE_TESTS=... not found in .ci/run"
    files = block.group(1).split()
    assert len(files) >= 4 and all((ROOT / name).is_file() for name in files), files
    assert 'CORE_PYTHONS="${NOTEBOOK_ACCEL_CI_PYTHONS-3.10 3.13}"' in CI
    assert '-e ".[test-core]"' in CI
    # Each side venv (about 4.8 GB with 3.10's and 3.13's CUDA torch) is installed without pip's cache and
    # removed before the main suite: one CI run ran out of disk with all of them kept.
    assert CI.count("--no-cache-dir") == 2
    assert 'rm -rf "$venv"' in CI and "rm -rf .venv-trackers" in CI
    assert CI.index("rm -rf .venv-trackers") < CI.index(_readme_commands()[1])


def test_the_test_core_extra_is_part_of_test_and_the_subset_venvs_are_ignored() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=;\[ ]", req)[0] for req in extras["test-core"]}
    assert {"pytest", "pytest-timeout", "nbval", "nbclient", "ipykernel"} <= names
    assert any("test-core" in req for req in extras["test"])
    # A file inside each venv: `.venv-*/` matches folders, and the venvs need not exist yet (a clean clone).
    inside = [".venv-py310/bin/python", ".venv-py313/bin/python"]
    ignored = subprocess.run(["git", "check-ignore", *inside], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == inside


def test_the_suite_runs_on_two_workers_taking_the_longest_files_first() -> None:
    from tests.conftest import _LONG_FILES

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-n 2 --dist loadfile --no-loadscope-reorder" in addopts  # whole files, in our order
    missing = [name for name in _LONG_FILES if not (ROOT / name).is_file()]
    assert not missing, f"renamed or removed: {missing}; list the file's new name in tests/conftest.py"
