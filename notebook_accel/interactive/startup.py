"""Starting a group: the launch of its ranks, then each rank connecting to the kernel and saying ``Ready``.

``start_group`` launches the ranks as a persistent launch whose function is ``rank_entry.rank_main``
(the one reference the kernel side holds to the rank side), with where to connect: the kernel's
Unix socket, or across nodes its agent's relay (``links.py`` holds both transports).
``accept_ranks`` runs in the cell that starts them: it takes their connections, checks each
``Ready`` (its protocol version; whether the rank could join the process group) and prints what the
ranks write meanwhile, until every rank is ready, the launch ended, or ``READY_SECONDS`` passed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from collections.abc import Hashable
from typing import Any

from ..launch.handle import LaunchHandle
from ..launch.request import LaunchRequest
from ..launch.runner import start_persistent_group
from ..nodes.plan import place_ranks
from ..utils._wire import unix_socket_path
from .cell_output import CellSink
from .group import Group
from .links import RankLinks, SocketLinks
from .protocol import MessageReader, Ready
from .rank_entry import rank_main
from .remote import relay_hook

__all__ = ["READY_SECONDS", "accept_ranks", "group_request", "start_group"]

READY_SECONDS = 120.0
"""How long the ranks get to form the group: the first import of torch.distributed on a loaded machine is slow."""


def accept_ranks(links: RankLinks, handle: LaunchHandle, sink: CellSink) -> dict[int, Hashable]:
    """Return each rank's connection (its key in ``links``), once every rank has formed the group and said ``Ready``.

    Raises RuntimeError when the ranks ended first or one could not join the group, TimeoutError
    after ``READY_SECONDS``, and ``protocol.ProtocolVersionError`` for a rank speaking another
    version of the protocol (another notebook_accel installation). On any error every connection
    of ``links`` is closed.
    """
    n = handle.num_processes
    conns: dict[int, Hashable] = {}
    readers: dict[Hashable, MessageReader] = {}  # connections that did not say Ready yet
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
            for key, data in links.wait(0.05):
                if not data:  # closed before saying ready: its exit tells why
                    readers.pop(key, None)
                    continue
                for message in readers.setdefault(key, MessageReader((Ready,))).feed(data):
                    conns[message.rank] = key
                    if message.problem:
                        raise RuntimeError(
                            f"rank {message.rank} could not join the process group: {message.problem}"
                        )
            sink.flush(printer)
    except BaseException:
        links.close()
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

    On this machine the ranks connect to a Unix socket of the kernel (``SocketLinks``); across
    nodes, to their agent's, which relays them (``RelayedLinks``, opened once the agents joined).
    The ranks are killed again when they do not all get ready (``accept_ranks`` says why).
    """
    sink = CellSink(not request.panel, request.log_line_prefix_template, num_processes or 1)
    request = dataclasses.replace(request, sinks=[sink])
    folder = None
    if request.nodes is not None:
        opened: list[RankLinks] = []
        handle = start_persistent_group(request, *place_ranks(request), on_join=relay_hook(request, opened))
        links = opened[0]
    else:
        address = unix_socket_path("notebook_accel-ranks-", "ranks.sock")  # bindable with a deep $TMPDIR too
        folder = os.path.dirname(address)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        links = SocketLinks(listener)
        try:
            listener.bind(address)
            listener.listen(64)
            request = dataclasses.replace(request, args=(address, listener.fileno(), request.args[2]))
            handle = start_persistent_group(request, *place_ranks(request))
        except BaseException:
            links.close()
            shutil.rmtree(folder, ignore_errors=True)
            raise
    sink._n, sink.window = handle.num_processes, request.collapse_seconds
    if handle.plan.hosts:  # across nodes: the prefix names the node, as notebook_launcher's does
        sink.hosts, sink._n = handle.plan.hosts, handle.plan.num_processes
    try:
        conns = accept_ranks(links, handle, sink)
    except BaseException:
        handle.kill()
        handle.wait(5)
        raise
    finally:
        links.stop_accepting()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return Group(handle, links, conns, sink)
