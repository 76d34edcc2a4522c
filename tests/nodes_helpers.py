"""A test-only placement: each "node" is the agent started as a plain subprocess on this machine.

The user-facing engines are Slurm and SSH (``notebook_accel.nodes.placement``, tested against real
ones on the namespace cluster); this one lets the channel, the agent and the kernel side be tested
everywhere with real processes, with the rendezvous on 127.0.0.1 (acceptable only because every
"node" really is this machine). It is a ``Placement`` like theirs: only how a command reaches a
node differs (it does not: it runs here).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from notebook_accel.nodes.placement import Placement
from notebook_accel.nodes.spec import Nodes


class LocalPlacement(Placement):
    """Places one agent per host name with ``subprocess.Popen`` here."""

    name = "local"

    def __init__(
        self,
        hosts: tuple[str, ...] = ("n1", "n2"),
        *,
        heartbeat: float = 0.5,
        join_timeout: float = 60.0,
        argv_for: Callable[[int], list[str] | None] | None = None,
    ) -> None:
        super().__init__(
            Nodes(hosts=list(hosts), engine="ssh", heartbeat=heartbeat, join_timeout=join_timeout)
        )
        self._argv_for = argv_for  # index -> another command for that node (one that fails to start)
        self.popens = []

    def hosts(self) -> list[str]:
        return list(self.nodes.hosts)

    def node_address(self, host: str) -> str | None:
        return "127.0.0.1"

    def command(self, host: str, argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
        index = self.nodes.hosts.index(host)
        other = self._argv_for(index) if self._argv_for is not None else None
        return (other or argv), {**os.environ, **self.nodes.env}

    def start(self, index, host, argv):
        popen = super().start(index, host, argv)
        self.popens.append(popen)
        return popen


def unix_listener(path: str, backlog: int = 1) -> socket.socket:
    """Return a Unix socket listening at ``path`` (the kernel's side of a rank's connection)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(backlog)
    return sock
