"""Loopback TCP ports: one free now (`llmstream run` gives its mini cluster's REST API one), and
whether one is taken (the local services check theirs before starting)."""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_ports", "port_in_use"]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the usual race applies; fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback TCP ports, each free a moment ago (a service's listener and its
    controller or RPC port, which must not be one)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``host:port`` cannot be bound (something listens there or holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
