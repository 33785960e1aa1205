"""A free loopback port kept for a test whose peer server goes down and comes back on it.

`deploy.processes.free_port` only says a port was free a moment ago: while the peer is
down (seconds, in the reconnect tests) another test's cluster could pick and bind it. A
socket bound here with SO_REUSEPORT, never listening, keeps the port from every other
bind (theirs do not set SO_REUSEPORT; Squall's services turn it off) while the test's own
`grpc.aio.server()`, which sets it by default, binds beside it and is the only listener.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from deploy.processes import free_ports

_ATTEMPTS = 20


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port held for the `with` block (bounded retries if picked and taken meanwhile)."""
    for _ in range(_ATTEMPTS):
        port = free_ports(1, host)[0]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            continue
        try:
            yield port
        finally:
            sock.close()
        return
    raise RuntimeError(f"no port on {host} could be held in {_ATTEMPTS} attempts")
