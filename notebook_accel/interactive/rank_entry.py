"""The function the launcher runs in each interactive rank: connect to the kernel, then serve its commands.

The kernel side names this entry point when it starts the ranks (``LaunchRequest(function=rank_main)``)
and otherwise knows the ranks only through ``protocol.py``; what a rank does with a command is
``rank_loop.py``'s.
"""

from __future__ import annotations

import os
import socket

from .gpus import use_gpus
from .rank_loop import RankLoop
from .remote import connect_rank

__all__ = ["rank_main"]


def _close_inherited(listener_fd: int | None, address: str) -> None:
    """Close the kernel's listening socket, inherited through fork (a spawned rank has none)."""
    if listener_fd is None:
        return
    try:
        probe = socket.socket(fileno=os.dup(listener_fd))
    except OSError:
        return
    try:
        mine = probe.family == socket.AF_UNIX and probe.getsockname() == address
    except OSError:
        mine = False
    finally:
        probe.close()
    if mine:
        os.close(listener_fd)


def rank_main(
    address: str,
    listener_fd: int | None = None,
    gpus: tuple[int, ...] | None = None,
    relay: str | None = None,
) -> None:
    """Serve the kernel's commands in this rank until it closes the connection (run by the launcher).

    ``relay``: the token of the relay through which a rank on another node reaches ``address``.
    """
    use_gpus(gpus)  # before anything starts CUDA here: rank r then uses cuda:r, which is gpus[r]
    _close_inherited(listener_fd, address)
    sock = connect_rank(address, relay)
    try:
        RankLoop(sock, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])).serve()
    finally:
        sock.close()
