"""What the ``record_*`` scripts share: their command line, the clean environment the real Accelerate runs in.

A recorder runs under our interpreter and re-runs itself as a worker (``--worker``) under the interpreter
with Accelerate 1.15 installed (``--python``); the worker prints or writes what it recorded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["CLEAN_ENV", "accelerate_version", "command_line", "run_worker"]

# No user configuration, no site customisation: what the real Accelerate sees on a fresh machine.
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}


def command_line(
    doc: str,
    worker: Callable[[argparse.Namespace], Any],
    needs: str = "accelerate==1.15",
    *,
    worker_lib: bool = False,
    hidden: tuple[str, ...] = (),
) -> argparse.Namespace:
    """Return the recorder's parsed command line; re-run as its own worker (``--worker``), run ``worker`` and exit.

    ``--python`` names the interpreter with ``needs`` installed. With ``worker_lib`` the worker is given the
    library to record (``--worker accelerate`` or ``--worker notebook_accel``) and needs no ``--python``;
    ``hidden`` options carry what else the worker is told.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--python", required=not worker_lib, help=f"interpreter with {needs} installed")
    if worker_lib:
        parser.add_argument("--worker", help=argparse.SUPPRESS)
    else:
        parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in hidden:
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        sys.exit(0)
    return ns


def accelerate_version(python: str) -> str:
    """Return the version of Accelerate that ``python`` imports."""
    argv = [python, "-c", "import accelerate; print(accelerate.__version__)"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def run_worker(python: str, script: str) -> tuple[str, dict]:
    """Return Accelerate's version and the JSON ``script --worker`` printed last, both run by ``python``.

    The worker runs in /tmp with the clean environment and an empty ``HF_HOME`` (no default config file
    of this machine's user).
    """
    env = {**CLEAN_ENV, "HF_HOME": tempfile.mkdtemp()}
    argv = [python, script, "--python", python, "--worker"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd="/tmp").stdout
    return accelerate_version(python), json.loads(out.strip().splitlines()[-1])
