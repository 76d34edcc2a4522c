"""Interactive ranks on other machines: the ``nodes=`` option of ``start_ranks`` and the rank's way home.

On one machine each rank connects to the kernel's Unix socket directly. A rank on another node
cannot: once the nodes' agents joined, :func:`relay_hook` has every agent listen on a Unix socket of
its own node (``NodeGroup.relay.open``), and the ranks, started after that, get the relay's
token as the fourth argument of ``rank_main``; :func:`connect_rank` finds that node's socket in the
rank's environment (``nodes.relay.relay_address``). Each connection made there travels over the
authenticated channel to the kernel's ``links.RelayedLinks`` (nothing per rank in the kernel: one
message per node carries a round's bytes, or a command for all its ranks). The frames are the same
as on one machine, so ``Group`` reads both transports alike.

Ranks on other machines always start as fresh interpreters (spawn): their namespaces hold only
``rank`` and ``world_size`` until values are pushed, and functions travel by value.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from typing import Any

from ..nodes.placement import Placement
from ..nodes.relay import relay_address
from ..nodes.spec import Nodes
from .links import RelayedLinks

__all__ = ["connect_rank", "relay_hook", "resolve_nodes"]


def resolve_nodes(nodes: Any, start_method: str) -> tuple[Nodes | Placement | None, str]:
    """Return ``(Nodes or None, the start method the ranks use)`` for ``start_ranks(nodes=..., start_method=...)``.

    Ranks on other machines cannot be forked from the kernel: with ``nodes`` the default "fork" means
    "spawn"; "forkserver" is refused (there is no kernel-side server to fork from on another machine).
    """
    if nodes is None:
        return None, start_method
    # A Placement is taken as is (as notebook_launcher takes it): how tests place agents on this machine.
    resolved = nodes if isinstance(nodes, Placement) else Nodes.of(nodes)
    if start_method not in (None, "fork", "spawn"):
        raise ValueError(
            f"start_method={start_method!r} with nodes=: ranks on other machines always start as fresh "
            "interpreters (spawn); leave start_method out, or pass start_method='spawn'"
        )
    return resolved, "spawn"


def relay_hook(request: Any, opened: list) -> Callable[[Any], Any]:
    """Return the ``on_join`` of ``start_persistent_group``: a relay on every node, its token for the ranks.

    The group's ``RelayedLinks`` (the kernel's end of the relayed streams) is appended to ``opened``.
    """

    def on_join(group: Any) -> Any:
        links = RelayedLinks(group.relay)
        opened.append(links)
        return dataclasses.replace(request, args=("", None, request.args[2], links.token))

    return on_join


def connect_rank(address: str, relay: str | None = None) -> socket.socket:
    """Return a socket connected to the kernel's listener: ``address`` directly, or relay ``relay``'s socket on this node."""
    if relay is not None:
        address = relay_address(relay)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock
