"""The rendezvous port: the default one when free, any free one otherwise, held by the launcher.

A single-node launch hosts the workers' TCPStore in the launching process itself (the workers are
its clients, as under torchrun: TORCHELASTIC_USE_AGENT_STORE=True). The port is bound before the
first fork and stays bound until the launch ends, so no other program can take it in between; with
port 0 the kernel picks a free one, so a busy default port costs nothing.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["DEFAULT_PORT", "find_free_port", "host_store", "port_is_free", "resolve_port"]

DEFAULT_PORT = "29500"


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def port_is_free(addr: str, port: int) -> bool:
    """Return True when a TCP server could listen on ``addr:port`` right now."""
    with socket.socket(_family(addr), socket.SOCK_STREAM) as sock:
        # Same option as torch's TCPStore: a port in TIME_WAIT from the previous launch is reusable.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
        return True


def find_free_port(addr: str = "127.0.0.1") -> int:
    """Return a port the kernel reports free on ``addr`` (bind to port 0)."""
    with socket.socket(_family(addr), socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def _local_bind_addr(master_addr: str) -> str | None:
    """Return the address to bind-test, or None when ``master_addr`` is not this machine."""
    if master_addr in ("", "localhost"):
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master_addr, None)
    except socket.gaierror as exc:
        raise ValueError(
            f"master_addr={master_addr!r} does not resolve ({exc}); pass an IP address or host name"
        ) from exc
    addr = infos[0][4][0]
    with socket.socket(_family(addr), socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            return None  # a remote master: its port cannot be checked from here
    return addr


def resolve_port(use_port: str | int, master_addr: str, *, check: bool = True) -> int:
    """Return the port to use: ``use_port`` when free; for the default port, a free one otherwise.

    A port the user chose explicitly that is taken is an error (they may run something there on
    purpose); the default port falls back to a free one, so that a second launch in the same kernel,
    or another program on 29500, does not fail with "address already in use".
    """
    try:
        port = int(str(use_port))
    except ValueError:
        raise ValueError(f"use_port={use_port!r} is not a port number; pass e.g. use_port='29500'") from None
    if not 0 < port < 65536:
        raise ValueError(f"use_port={use_port!r} is out of range; a TCP port is between 1 and 65535")
    if not check:
        return port
    bind_addr = _local_bind_addr(master_addr)
    if bind_addr is None or port_is_free(bind_addr, port):
        return port
    if str(use_port) == DEFAULT_PORT:
        return find_free_port(bind_addr)
    raise RuntimeError(
        f"use_port={use_port!r} is already in use on {master_addr}; stop what listens there, pick another "
        f"port, or leave use_port at its default ({DEFAULT_PORT!r}) to get a free port automatically"
    )


def host_store(use_port: str | int, *, fallback: bool, timeout_s: float = 1800.0):
    """Return a TCPStore server listening on ``use_port`` (or, if taken and ``fallback``, a free port).

    Raises RuntimeError naming the port when it is taken and ``fallback`` is False.
    """
    from datetime import timedelta

    import torch.distributed as dist

    port = 0 if str(use_port) == "0" else resolve_port(use_port, "127.0.0.1", check=False)

    def make(p: int):
        return dist.TCPStore("0.0.0.0", p, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)

    try:
        return make(port)
    except RuntimeError as exc:
        if "EADDRINUSE" not in str(exc) and "in use" not in str(exc):
            raise
        if not fallback:
            raise RuntimeError(
                f"use_port={str(use_port)!r} is already in use on this machine; stop what listens there, pick "
                f"another port, or leave use_port at its default ({DEFAULT_PORT!r}) to get a free port "
                "automatically"
            ) from None
    return make(0)
