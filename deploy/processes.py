"""Starting, checking and stopping Squall service processes on one machine.

Shared by the local launcher (`make run`) and the integration tests, so both start
services the same way an operator's unit files do: one process per service, found
again by PID, never by name.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import tomli_w
from grpc_health.v1 import health_pb2, health_pb2_grpc

from squall_server.common.tls import Transport, plain_or

# Ports are picked below the kernel's ephemeral range where it is known: an outgoing
# connection (a client's, a console's polls) takes its local port from that range, and
# could take a port picked here before its service binds it (seen once in CI: a replica's
# "Failed to bind" while the console polled the starting gateway).
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICK_SPAN = 10_000
_PICK_ATTEMPTS = 1_000


def _pick_span() -> tuple[int, int] | None:
    """The ports to pick from (below the ephemeral range), or None: let the OS choose."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if low - _PICK_SPAN < 1024:
        return None
    return low - _PICK_SPAN, low - 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on host."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """count distinct TCP ports that were free a moment ago on host.

    The sockets are held open together while the ports are picked, so no two are the
    same (free_port called twice may get the same port back once it was released).
    """
    span = _pick_span()
    rng = random.Random()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(_PICK_ATTEMPTS):  # bounded: a taken port is skipped
            if len(ports) == count:
                break
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((host, rng.randint(*span) if span else 0))
            except OSError:
                continue
            ports.append(int(sock.getsockname()[1]))
        if len(ports) < count:
            raise RuntimeError(f"found {len(ports)} of {count} free ports on {host} in {span}")
        return ports


@dataclass
class Service:
    """One running service process."""

    kind: str  # replica | coordinator | gateway
    name: str  # node or gateway id
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid


def service_command(kind: str, config_path: Path, name: str) -> list[str]:
    """The command line that starts one service."""
    flag = "--gateway" if kind == "gateway" else "--node"
    module = f"squall_server.{kind}"
    return [sys.executable, "-m", module, "--config", str(config_path), flag, name]


def start_service(
    kind: str,
    config_path: Path,
    name: str,
    address: str,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> Service:
    """Starts a service in its own process group, its output appended to log_path.

    prefix goes before the command; it must exec the command in its own process (as
    `ip netns exec NS` does), so the PID stays the service's.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [*prefix, *service_command(kind, config_path, name)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return Service(kind, name, address, process, log_path)


def is_serving(address: str, timeout_s: float = 0.5, links: Transport | None = None) -> bool:
    """True if the gRPC health service at address answers SERVING (over links' TLS if given)."""
    with plain_or(links, address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_serving(
    services: Iterable[Service], timeout_s: float = 30.0, links: Transport | None = None
) -> None:
    """Waits until every service is healthy; raises with its log tail if one is not."""
    deadline = time.monotonic() + timeout_s
    for service in services:
        while not is_serving(service.address, links=links):
            if service.process.poll() is not None:
                raise RuntimeError(
                    f"{service.kind} {service.name} exited with status "
                    f"{service.process.returncode}:\n{tail(service.log_path)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{service.kind} {service.name} not serving on {service.address} after "
                    f"{timeout_s:.0f}s:\n{tail(service.log_path)}"
                )
            time.sleep(0.05)


def stop_pid(pid: int, timeout_s: float = 10.0) -> bool:
    """SIGTERM, wait up to timeout_s, then SIGKILL. True if the process had been running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def _alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        if finished == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall back to probing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_service(service: Service, timeout_s: float = 10.0) -> None:
    """Stops one service by PID and reaps it."""
    if service.process.poll() is None:
        service.process.terminate()
        try:
            service.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait(timeout_s)


def kill_service(service: Service) -> None:
    """kill -9: the crash case."""
    if service.process.poll() is None:
        service.process.kill()
        service.process.wait(10)


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file (for error messages)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def port_is_free(address: str) -> bool:
    """Whether host:port can be bound right now (a moment later it may not be)."""
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, int(port)))
        except (OSError, ValueError):
            return False
    return True


def localize_config(source: Path, run_dir: Path, keep_gateway: bool = False) -> Path:
    """Copies a cluster config into run_dir with free loopback ports and local data dirs.

    Returns the new file's path. The source's structure and every other setting are
    kept, so what runs locally is what the file describes; Prometheus scrape ports become
    0 (picked at start-up and logged), as every node shares the one host. With
    keep_gateway (`make run`), the first gateway keeps its configured loopback address if
    that port is free, so the `squall` command's default gateway reaches it.
    """
    document: dict[str, Any] = tomllib.loads(source.read_text())
    nodes, gateways = document.get("nodes", []), document.get("gateways", [])
    ports = iter(free_ports(2 * len(nodes) + len(gateways) + 1))  # + 1: the console's
    for node in nodes:
        node["coordinator_address"] = f"127.0.0.1:{next(ports)}"
        node["replica_address"] = f"127.0.0.1:{next(ports)}"
        node["data_dir"] = str((run_dir / "data" / str(node["id"])).resolve())
    for index, gateway in enumerate(gateways):
        configured = str(gateway.get("address", ""))
        keep = keep_gateway and index == 0 and configured.startswith("127.")
        if not (keep and port_is_free(configured)):
            gateway["address"] = f"127.0.0.1:{next(ports)}"
    console = document.get("console", {})
    if isinstance(console, dict) and console.get("enabled"):
        # The gateway-served console ([console]) gets a free loopback port too.
        configured = str(console.get("address", "127.0.0.1:7180"))
        if not (keep_gateway and configured.startswith("127.") and port_is_free(configured)):
            console["address"] = f"127.0.0.1:{next(ports)}"
    telemetry = document.get("telemetry", {})
    for key in (
        "coordinator_prometheus_port",
        "replica_prometheus_port",
        "gateway_prometheus_port",
    ):
        if key in telemetry:
            # Every node's service of a kind shares one host here: each picks a free port
            # and logs it ("metrics endpoint http://...").
            telemetry[key] = 0
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "cluster.toml"
    target.write_text(dump_toml(document))
    return target


def dump_toml(document: Mapping[str, Any]) -> str:
    """A config document as TOML text, by a real TOML writer (quoting, escapes, tables)."""
    return tomli_w.dumps(document)
