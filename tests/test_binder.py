"""binder/ builds a working environment: a fresh venv from its files imports the package and runs the quickstart.

Slow (it installs torch and the panels stack into a new virtual environment, from pip's cache and the
machine's configured indexes), so it is marked ``slow``; it stays in the default suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"

# What mybinder.org's base image brings along with JupyterLab and that the quickstart runner uses.
_RUNNER_PACKAGES = ["nbclient", "nbconvert"]


def _venv_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    # Use the indexes and caches this machine's pip is configured with (torch's CPU wheel is on
    # local disk here); mybinder.org itself uses the CPU wheel index named in postBuild.
    env["NOTEBOOK_ACCEL_TORCH_INDEX"] = ""
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # No byte-compiling of the thousands of modules torch and transformers bring (Python compiles what the
    # quickstart imports as it imports it): a minute or more of this test's CPU on a 2-core machine.
    env["PIP_COMPILE"] = "0"
    return env


def _run(
    cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def test_binder_files_are_what_mybinder_reads() -> None:
    post_build = BINDER / "postBuild"
    assert post_build.is_file() and os.access(post_build, os.X_OK), "binder/postBuild must be executable"
    text = post_build.read_text(encoding="utf-8")
    assert "-c constraints.txt" in text and '".[panels,clients]"' in text
    runtime = (BINDER / "runtime.txt").read_text(encoding="utf-8").strip()
    assert runtime.startswith("python-3.") and int(runtime.split(".")[1]) >= 10, runtime


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fresh_venv_from_binder_runs_the_quickstart(tmp_path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("binder/postBuild is a bash script and bash is not installed")
    venv = tmp_path / "binder-venv"
    try:
        _build_and_run_quickstart(venv, tmp_path)
    finally:
        # About 800 MB: gone once the test is over, so that the rest of the suite does not run short of disk.
        shutil.rmtree(venv, ignore_errors=True)


def _build_and_run_quickstart(venv: Path, tmp_path: Path) -> None:
    # A plain venv: nothing from this interpreter's site-packages is visible inside it.
    proc = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, _explain(proc)
    python = str(venv / "bin" / "python")
    env = _venv_env(venv)

    probe = _run([python, "-m", "pip", "install", "--dry-run", "--no-deps", "-q", "psutil"], env, timeout=300)
    if probe.returncode != 0:
        pytest.skip(
            f"pip cannot reach a package index from here, so binder/ cannot be installed:\n{_explain(probe)}"
        )

    proc = _run(["bash", str(BINDER / "postBuild")], env, timeout=600)
    assert proc.returncode == 0, f"binder/postBuild failed: {_explain(proc)}"

    check = (
        "import sys, notebook_accel, notebook_accel.widgets, torch, ipywidgets;"
        "assert sys.prefix == sys.argv[1], (sys.prefix, sys.argv[1]);"
        "print(notebook_accel.__version__, torch.__version__, notebook_accel.__file__)"
    )
    proc = _run([python, "-c", check, str(venv)], env, timeout=120)
    assert proc.returncode == 0, _explain(proc)
    assert Path(proc.stdout.split()[-1]).resolve().is_relative_to(ROOT), proc.stdout

    proc = _run(
        [python, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), *_RUNNER_PACKAGES],
        env,
        timeout=300,
    )
    assert proc.returncode == 0, _explain(proc)
    out_dir = tmp_path / "artifacts"
    proc = _run(
        [python, str(ROOT / "scripts" / "run_quickstart.py"), "--output-dir", str(out_dir)], env, timeout=300
    )
    assert proc.returncode == 0, f"the quickstart failed in the Binder environment: {_explain(proc)}"
    assert (out_dir / "quickstart.executed.ipynb").is_file()
    assert (out_dir / "quickstart.html").is_file()
