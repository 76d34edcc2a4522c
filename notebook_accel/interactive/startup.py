"""Starting a group: the launch of its ranks, then each rank connecting to the kernel's socket and saying ``Ready``.

``start_group`` launches the ranks as a persistent launch whose function is ``rank_entry.rank_main``
(the one reference the kernel side holds to the rank side), with a Unix socket to connect to.
``accept_ranks`` runs in the cell that starts them: it accepts their connections, checks each
``Ready`` (its protocol version; whether the rank could join the process group) and prints what the
ranks write meanwhile, until every rank is ready, the launch ended, or ``READY_SECONDS`` passed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from typing import Any

from ..launch.handle import LaunchHandle
from ..launch.request import LaunchRequest
from ..launch.runner import start_persistent_group
from ..nodes.plan import place_ranks
from ..utils._wire import readable, unix_socket_path
from .cell_output import CellSink
from .group import Group
from .protocol import Ready, receive
from .rank_entry import rank_main
from .remote import relay_hook

__all__ = ["READY_SECONDS", "accept_ranks", "group_request", "start_group"]

READY_SECONDS = 120.0
"""How long the ranks get to form the group: the first import of torch.distributed on a loaded machine is slow."""


def accept_ranks(listener: socket.socket, handle: LaunchHandle, sink: CellSink) -> dict[int, socket.socket]:
    """Return each rank's connected socket, once every rank has formed the group and said ``Ready``.

    Raises RuntimeError when the ranks ended first or one could not join the group, TimeoutError
    after ``READY_SECONDS``, and ``protocol.ProtocolVersionError`` for a rank speaking another
    version of the protocol (another notebook_accel installation).
    """
    n = handle.num_processes
    conns: dict[int, socket.socket] = {}
    waiting: list[socket.socket] = []
    printer = sink.printer()
    deadline = time.monotonic() + READY_SECONDS
    sink.begin(printer)  # what the ranks print while they start: by this thread, into the calling cell
    try:
        while len(conns) < n:
            if handle.done:
                error = handle.error
                raise RuntimeError(f"the ranks ended before they were ready: {error or 'no error reported'}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the ranks were not ready within {READY_SECONDS:g} s; see their output above"
                )
            ready = readable([listener, *waiting], 0.05)
            for sock in ready:
                if sock is listener:
                    waiting.append(listener.accept()[0])
                    continue
                message = receive(sock, (Ready,))  # a ProtocolError leaves it in waiting: closed below
                waiting.remove(sock)
                if not isinstance(message, Ready):  # closed before saying ready: its exit tells why
                    sock.close()
                    continue
                conns[message.rank] = sock
                if message.problem:
                    raise RuntimeError(
                        f"rank {message.rank} could not join the process group: {message.problem}"
                    )
            sink.flush(printer)
    except BaseException:
        for sock in (*conns.values(), *waiting):
            sock.close()
        raise
    finally:
        sink.end(printer)
    return conns


def group_request(options: dict[str, Any], gpus: tuple[int, ...] | None) -> LaunchRequest:
    """Return the checked request of a group whose ranks run ``rank_main`` (``options``: ``start_ranks``' own).

    Refused here, before anything starts: an option a persistent group does not take, a bad value.
    Each start fills in the address of its socket (``start_group``).
    """
    return LaunchRequest.persistent(rank_main, ("", None, gpus), **options)


def start_group(request: LaunchRequest, num_processes: int | None) -> Group:
    """Return the started group of ranks ``request`` (``group_request``'s) describes, every rank ready.

    The ranks are killed again when they do not all get ready (``accept_ranks`` says why).
    """
    address = unix_socket_path("notebook_accel-ranks-", "ranks.sock")  # bindable with a deep $TMPDIR too
    folder = os.path.dirname(address)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    remote = request.nodes is not None
    try:
        listener.bind(address)
        listener.listen(64)
        sink = CellSink(not request.panel, request.log_line_prefix_template, num_processes or 1)
        # Ranks elsewhere inherit no listener to close (and reach this one through their agent).
        request = dataclasses.replace(
            request, args=(address, None if remote else listener.fileno(), request.args[2]), sinks=[sink]
        )
        # Across nodes the ranks start once the agents joined and relay this socket (remote.py).
        on_join = relay_hook(request, address) if remote else None
        handle = start_persistent_group(request, *place_ranks(request), on_join=on_join)
        sink._n, sink.window = handle.num_processes, request.collapse_seconds
        if handle.plan.hosts:  # across nodes: the prefix names the node, as notebook_launcher's does
            sink.hosts, sink._n = handle.plan.hosts, handle.plan.num_processes
        try:
            conns = accept_ranks(listener, handle, sink)
        except BaseException:
            handle.kill()
            handle.wait(5)
            raise
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
    return Group(handle, conns, sink)
