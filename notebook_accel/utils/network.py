"""Ports on this machine: is one taken, and which one is free (for a rendezvous)."""

from __future__ import annotations

import os
import socket

__all__ = ["get_free_port", "is_port_in_use"]

# torch.distributed's default rendezvous port.
_DEFAULT_PORT = 29500


def is_port_in_use(port: int | None = None) -> bool:
    """Return whether something listens on ``port`` of localhost (default: ``MASTER_PORT`` or 29500)."""
    if port is None:
        port = int(os.environ.get("MASTER_PORT", _DEFAULT_PORT))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", int(port))) == 0


def get_free_port() -> int:
    """Return a port of localhost that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
