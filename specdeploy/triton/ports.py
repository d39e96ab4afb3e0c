"""The server's loopback ports: the recipe's, or free ones."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from specdeploy.core.errors import ServerError

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


@dataclass(frozen=True)
class Ports:
    grpc: int
    http: int
    metrics: int

    @classmethod
    def pick(cls, grpc: int = 0, http: int = 0, metrics: int = 0) -> "Ports":
        """The given ports (0 = a free loopback port); a given port in use is an error."""
        chosen = []
        for name, port in (("grpc_port", grpc), ("http_port", http), ("metrics_port", metrics)):
            if port and _port_taken(port):
                raise ServerError(
                    f"port {port} (triton.{name}) is already in use", f"set triton.{name}: 0 to pick a free one"
                )
            while not port or port in chosen:
                port = free_port()
            chosen.append(port)
        return cls(*chosen)
