"""Interactive ranks on other machines: the ``nodes=`` option of ``start_ranks`` and the rank's way home.

On one machine each rank connects to the kernel's Unix socket directly. A rank on another node
cannot: its node's agent (``notebook_accel.nodes.agent``) listens on a private Unix socket there,
names it in the rank's environment (:data:`RELAY_ENV`), and relays each connection over the
authenticated channel to the kernel, which connects it to the kernel's real listener. The rank first
sends one header frame, the path of the kernel's listener it was given, so the kernel side knows where
the stream goes and refuses anything that is not an interactive ranks' socket (:func:`check_target`).
Everything after the header is the same frames as on one machine, so ``Group`` needs no change.

Ranks on other machines always start as fresh interpreters (spawn): their namespaces hold only
``rank`` and ``world_size`` until values are pushed, and functions travel by value.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile
from typing import Any

from ..nodes.spec import Nodes

__all__ = ["FOLDER_PREFIX", "RELAY_ENV", "check_target", "connect_rank", "read_target", "resolve_nodes"]

RELAY_ENV = "NOTEBOOK_ACCEL_RELAY_SOCKET"
"""Set by a node's agent for the ranks it starts: the Unix socket on that node that reaches the kernel."""

FOLDER_PREFIX = "notebook_accel-ranks-"
"""The private folder (``tempfile.mkdtemp``) holding the kernel's listener of one group of ranks."""

_HEADER = struct.Struct(">I")
_MAX_TARGET = 4096  # bytes of a path: PATH_MAX; a longer header is not ours


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
        target = os.fsencode(address)
        sock.sendall(_HEADER.pack(len(target)) + target)
    except BaseException:
        sock.close()
        raise
    return sock


def read_target(data: bytes) -> tuple[str, bytes] | None:
    """Return ``(target path, the bytes after the header)`` once ``data`` holds the header, else None.

    Raises ValueError for a header no rank writes (longer than a path).
    """
    if len(data) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack_from(data)
    if size == 0 or size > _MAX_TARGET:
        raise ValueError(f"a relayed stream's header names a {size}-byte path; expected 1..{_MAX_TARGET}")
    end = _HEADER.size + size
    if len(data) < end:
        return None
    return os.fsdecode(data[_HEADER.size : end]), data[end:]


def check_target(path: str) -> str:
    """Return ``path`` when it is the socket of interactive ranks on this machine, else raise PermissionError.

    A relayed stream may only reach a listener ``start_ranks`` made (a socket in a private
    ``notebook_accel-ranks-*`` folder of this user's temporary directory), never another socket.
    """
    real = os.path.realpath(path)
    folder = os.path.dirname(real)
    root = os.path.realpath(tempfile.gettempdir())
    try:
        info, folder_info = os.stat(real), os.stat(folder)
    except OSError as exc:
        raise PermissionError(f"relayed stream to {path!r} refused: {exc.strerror}") from None
    ours = (
        os.path.dirname(folder) == root
        and os.path.basename(folder).startswith(FOLDER_PREFIX)
        and stat.S_ISSOCK(info.st_mode)
        and folder_info.st_uid == os.getuid()
        and stat.S_IMODE(folder_info.st_mode) & 0o077 == 0
    )
    if not ours:
        raise PermissionError(
            f"relayed stream to {path!r} refused: only the socket of interactive ranks "
            f"({root}/{FOLDER_PREFIX}*/...) may be reached through a node's agent"
        )
    return real
