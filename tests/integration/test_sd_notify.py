"""Type=notify (deploy/systemd/): each real service tells a (fake) systemd notify socket
READY=1 once it serves and STOPPING=1 when SIGTERM stops it, from its own PID."""

from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import LocalCluster

# How long a loaded machine may take to deliver a service's datagram after the fact.
RECEIVE_TIMEOUT_S = 20.0


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    # A short directory: a Unix socket path must fit in 108 bytes, tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="sqn-") as directory:
        path = str(Path(directory) / "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        try:
            yield sock, path
        finally:
            sock.close()


def _messages(
    sock: socket.socket, until: Callable[[list[dict[str, str]]], bool]
) -> list[dict[str, str]]:
    """Every datagram received until `until(received)` holds (bounded by RECEIVE_TIMEOUT_S)."""
    received: list[dict[str, str]] = []
    deadline = time.monotonic() + RECEIVE_TIMEOUT_S
    while not until(received):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; received {received}"
        sock.settimeout(remaining)
        data = sock.recv(4096).decode()
        received.append(dict(line.split("=", 1) for line in data.splitlines()))
    return received


def test_every_service_notifies_ready_once_serving_and_stopping_on_sigterm(
    cluster_factory: Callable[..., LocalCluster], notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    cluster = cluster_factory()
    cluster.env["NOTIFY_SOCKET"] = path
    cluster.start_all()  # returns once each service answers health checks as SERVING
    pids = {service.process.pid: kind for (kind, _), service in cluster.services.items()}
    assert sorted(pids.values()) == ["coordinator", "gateway", "replica"]

    ready = _messages(
        sock, lambda got: {int(m["MAINPID"]) for m in got if m.get("READY") == "1"} >= set(pids)
    )
    for message in ready:
        assert message["READY"] == "1" and message["STATUS"].startswith("serving on 127.0.0.1:")
    addresses = {int(m["MAINPID"]): m["STATUS"].removeprefix("serving on ") for m in ready}
    for (kind, _), service in cluster.services.items():
        assert addresses[service.process.pid] == service.address, kind

    cluster.stop("gateway", "g1")
    stopping = _messages(sock, lambda got: any(m.get("STOPPING") == "1" for m in got))
    assert stopping[-1]["STATUS"] == f"stopping (was serving on {cluster.gateway_address})"
    assert all("READY" not in m for m in stopping)
