"""A test-only placement: each "node" is the agent started as a plain subprocess on this machine.

The user-facing engines are Slurm and SSH (``notebook_accel.nodes.placement``, tested against real
ones on the namespace cluster); this one lets the channel, the agent and the kernel side be tested
everywhere with real processes, with the rendezvous on 127.0.0.1 (acceptable only because every
"node" really is this machine).
"""

from __future__ import annotations

import os
import subprocess
import types


class LocalPlacement:
    """Places one agent per host name with ``subprocess.Popen`` here (stdin/stdout/stderr pipes)."""

    name = "local test placement"

    def __init__(
        self, hosts=("n1", "n2"), *, heartbeat=0.5, join_timeout=60.0, python=None, env=None, argv_for=None
    ):
        self._hosts = list(hosts)
        self.nodes = types.SimpleNamespace(python=python, heartbeat=heartbeat, join_timeout=join_timeout)
        self._env = env or {}
        self._argv_for = argv_for  # index -> argv override (a node that fails to start)
        self.popens: list[subprocess.Popen] = []

    def hosts(self) -> list[str]:
        return list(self._hosts)

    def kernel_address(self) -> str:
        return "127.0.0.1"

    def start(self, index: int, host: str, argv: list[str]) -> subprocess.Popen:
        if self._argv_for is not None and self._argv_for(index) is not None:
            argv = self._argv_for(index)
        popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **self._env}, start_new_session=True,
        )  # fmt: skip
        self.popens.append(popen)
        return popen

    def failure(self, index: int, host: str, popen: subprocess.Popen) -> str:
        err = popen.stderr.read().decode(errors="replace").strip() if popen.stderr else ""
        return f"exit code {popen.returncode}: {err}"
