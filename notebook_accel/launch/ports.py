"""The rendezvous port: the default one when free, any free one otherwise, held by the launcher.

A single-node launch hosts the workers' TCPStore in the launching process itself (the workers are
its clients, as under torchrun: TORCHELASTIC_USE_AGENT_STORE=True). The port is bound before the
first fork and stays bound until the launch ends, so no other program can take it in between; with
port 0 the kernel picks a free one, so a busy default port costs nothing.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["DEFAULT_PORT", "check_master_addr", "host_store", "parse_port"]

DEFAULT_PORT = "29500"


def parse_port(use_port: str | int) -> int:
    """Return ``use_port`` as an int; raise ValueError when it is not a TCP port number."""
    try:
        port = int(str(use_port))
    except ValueError:
        raise ValueError(f"use_port={use_port!r} is not a port number; pass e.g. use_port='29500'") from None
    if not 0 < port < 65536:
        raise ValueError(f"use_port={use_port!r} is out of range; a TCP port is between 1 and 65535")
    return port


def check_master_addr(master_addr: str) -> None:
    """Raise ValueError when ``master_addr`` does not resolve (before anything is forked)."""
    if master_addr in ("", "localhost"):
        return
    try:
        socket.getaddrinfo(master_addr, None)
    except socket.gaierror as exc:
        raise ValueError(
            f"master_addr={master_addr!r} does not resolve ({exc}); pass an IP address or host name"
        ) from exc


def _listen(host: str, port: int) -> socket.socket:
    """Return a socket listening on ``host:port`` (the address itself, not every interface)."""
    family, kind, proto, _, address = socket.getaddrinfo(host or "127.0.0.1", port, type=socket.SOCK_STREAM)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def host_store(use_port: str | int, *, fallback: bool, host: str = "127.0.0.1", timeout_s: float = 1800.0):
    """Return a TCPStore server listening on ``host:use_port`` (or, if taken and ``fallback``, a free port).

    ``use_port`` 0 asks for any free port. The store listens on ``host`` only (the rendezvous
    address), so a launch on 127.0.0.1 cannot be reached from the network. Raises RuntimeError naming
    the port when it is taken and ``fallback`` is False (the user chose it: they may run something
    there on purpose), and ValueError when ``host`` is not an address of this machine.
    """
    from datetime import timedelta

    import torch.distributed as dist

    port = 0 if str(use_port) == "0" else parse_port(use_port)
    try:
        sock = _listen(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(
                f"master_addr={host!r} is not an address of this machine, so the rendezvous cannot listen "
                "there; on one machine leave master_addr at '127.0.0.1'"
            ) from None
        if exc.errno != errno.EADDRINUSE:
            raise
        if not fallback:
            raise RuntimeError(
                f"use_port={str(use_port)!r} is already in use on this machine; stop what listens there, pick "
                f"another port, or leave use_port at its default ({DEFAULT_PORT!r}) to get a free port "
                "automatically"
            ) from None
        sock = _listen(host, 0)
    bound = sock.getsockname()[1]
    try:
        store = dist.TCPStore(
            host, bound, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
            master_listen_fd=sock.fileno(), use_libuv=True,
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it when it stops
    return store
