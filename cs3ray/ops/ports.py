"""A free TCP port on this machine, for the local servers and Ray listeners we start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS reports free on 127.0.0.1 right now (another process may still take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
