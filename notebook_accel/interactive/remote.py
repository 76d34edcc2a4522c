"""Interactive ranks on other machines: the ``nodes=`` option of ``start_ranks`` and the rank's way home.

On one machine each rank connects to the kernel's Unix socket directly. A rank on another node
cannot: its node's agent (``notebook_accel.nodes.agent``) listens on a private Unix socket there,
names it in the rank's environment (:data:`RELAY_ENV`), and relays each connection over the
authenticated channel to the kernel, which connects it to the kernel's real listener. The rank first
sends one header, the path of the kernel's listener it was given, so the kernel side knows where the
stream goes and refuses anything that is not an interactive ranks' socket (``nodes/streams.py``).
Everything after the header is the same frames as on one machine, so ``Group`` needs no change.

Ranks on other machines always start as fresh interpreters (spawn): their namespaces hold only
``rank`` and ``world_size`` until values are pushed, and functions travel by value.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ..nodes.spec import Nodes
from ..nodes.streams import pack_target

__all__ = ["RELAY_ENV", "connect_rank", "resolve_nodes"]

RELAY_ENV = "NOTEBOOK_ACCEL_RELAY_SOCKET"
"""Set by a node's agent for the ranks it starts: the Unix socket on that node that reaches the kernel."""


def resolve_nodes(nodes: Any, start_method: str) -> tuple[Nodes | None, str]:
    """Return ``(Nodes or None, the start method the ranks use)`` for ``start_ranks(nodes=..., start_method=...)``.

    Ranks on other machines cannot be forked from the kernel: with ``nodes`` the default "fork" means
    "spawn"; "forkserver" is refused (there is no kernel-side server to fork from on another machine).
    """
    if nodes is None:
        return None, start_method
    resolved = Nodes.of(nodes)
    if start_method not in ("fork", "spawn"):
        raise ValueError(
            f"start_method={start_method!r} with nodes=: ranks on other machines always start as fresh "
            "interpreters (spawn); leave start_method out, or pass start_method='spawn'"
        )
    return resolved, "spawn"


def connect_rank(address: str) -> socket.socket:
    """Return a socket connected to the kernel's listener ``address``: directly, or through this node's agent.

    Through the agent (:data:`RELAY_ENV` set), the first frame names ``address`` so the kernel side
    connects the stream to it.
    """
    relay = os.environ.get(RELAY_ENV)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not relay:
            sock.connect(address)
            return sock
        sock.connect(relay)
        sock.sendall(pack_target(address))
    except BaseException:
        sock.close()
        raise
    return sock
