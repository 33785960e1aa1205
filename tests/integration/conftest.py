"""Real Squall processes on free loopback ports, stopped by PID whatever happens."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from deploy import processes
from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)
from squall_server.common.config import ClusterConfig, load_config
from squall_server.common.tls import Transport, cli_transport, plain_or

ROOT = Path(__file__).resolve().parents[2]
# How long every process of a cluster started at once may take to serve (a loaded 2-core
# machine starts seven Python processes in a few seconds; bounded generously).
_START_ALL_TIMEOUT_S = 60.0


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Polls condition until it holds; fails the test with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.02)


def run_squall(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs the `squall` command line (`python -m squall_server ARGS`) from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "squall_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


@dataclass
class LocalCluster:
    """A cluster of service processes started from one config file."""

    config_path: Path
    config: ClusterConfig
    run_dir: Path
    services: dict[tuple[str, str], processes.Service] = field(default_factory=dict)
    # Environment for every service process, and metadata for the fixture's own status
    # calls (an admin token when [auth] is on).
    env: dict[str, str] = field(default_factory=dict)
    metadata: tuple[tuple[str, str], ...] = ()

    @property
    def gateway_address(self) -> str:
        """The first gateway's address."""
        return self.config.gateways[0].address

    @property
    def links(self) -> Transport | None:
        """The admin identity's TLS links when [tls] is on (None: plaintext)."""
        return cli_transport(self.config) if self.config.tls.enabled else None

    def dial(self, address: str) -> grpc.Channel:
        """A blocking channel to any service of the cluster, over TLS when it is on."""
        return plain_or(self.links, address)

    def replica_address(self, node_id: str) -> str:
        """One node's replica address."""
        return self.config.node(node_id).replica_address

    def spawn(self, kind: str, name: str, config_path: Path | None = None) -> processes.Service:
        """Starts (or restarts) one service without waiting for it to serve."""
        if kind == "gateway":
            address = self.config.gateway(name).address
        elif kind == "replica":
            address = self.config.node(name).replica_address
        else:
            address = self.config.node(name).coordinator_address
        service = processes.start_service(
            kind,
            config_path or self.config_path,
            name,
            address,
            self.run_dir / "logs" / f"{kind}-{name}.log",
            env=self.env,
        )
        self.services[(kind, name)] = service
        return service

    def start(self, kind: str, name: str, config_path: Path | None = None) -> processes.Service:
        """Starts (or restarts) one service and waits until it is serving.

        ``config_path`` starts it from another file than the cluster's (a node whose file
        differs)."""
        service = self.spawn(kind, name, config_path)
        processes.wait_serving([service], links=self.links)
        return service

    def start_node(self, node_id: str, config_path: Path | None = None) -> None:
        """Starts one node: its replica, then its coordinator (from ``config_path`` if
        given)."""
        self.start("replica", node_id, config_path)
        self.start("coordinator", node_id, config_path)

    def kill_node(self, node_id: str) -> None:
        """kill -9 both of a node's processes."""
        self.kill("coordinator", node_id)
        self.kill("replica", node_id)

    def start_all(self, wait_for_master: bool = True) -> None:
        """Starts every node and gateway, then waits until a master is elected.

        In three steps, each starting its processes at once and waiting until they all
        serve: every replica; the first node's coordinator; the other coordinators and the
        gateways. As one at a time did, each coordinator finds its replica serving and
        the highest-ranked node is there first (tests expect it to lead); started one at a
        time, each waiting for the one before, a three-node cluster took about three times
        as long on two cores (each process spends its first second importing)."""
        nodes, gateways = self.config.nodes, self.config.gateways
        steps = [
            [("replica", node.id) for node in nodes],
            [("coordinator", node.id) for node in nodes[:1]],
            [("coordinator", node.id) for node in nodes[1:]]
            + [("gateway", gateway.id) for gateway in gateways],
        ]
        for step in steps:
            started = [self.spawn(kind, name) for kind, name in step]
            processes.wait_serving(started, timeout_s=_START_ALL_TIMEOUT_S, links=self.links)
        if wait_for_master:
            self.wait_for_master()
            self.wait_for_one_cluster_id()

    def statuses(self) -> dict[str, coordinator_pb2.CoordinatorStatus]:
        """Every reachable coordinator's status."""
        result = {}
        for node in self.config.nodes:
            service = self.services.get(("coordinator", node.id))
            if service is None or service.process.poll() is not None:
                continue
            with self.dial(node.coordinator_address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                try:
                    result[node.id] = stub.GetStatus(
                        coordinator_pb2.GetStatusRequest(),
                        timeout=2,
                        metadata=self.metadata or None,
                    )
                except grpc.RpcError:
                    continue
        return result

    def wait_for_master(self, timeout_s: float = 30.0, exclude: str = "") -> str:
        """Waits until one coordinator is NORMAL as master and its replica is master."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node_id, status in self.statuses().items():
                if (
                    node_id != exclude
                    and status.state == common_pb2.NODE_STATE_NORMAL
                    and status.coordinator_id == node_id
                    and self.replica_role(node_id) == common_pb2.ROLE_MASTER
                ):
                    return node_id
            time.sleep(0.05)
        raise TimeoutError(f"no master elected within {timeout_s}s: {self.statuses()}")

    def wait_for_one_cluster_id(self, timeout_s: float = 10.0) -> str:
        """Waits until every running replica reports the same, non-empty cluster id.

        The first group's coordinator mints the id and every member records it when its
        replica takes the role, so this holds shortly after the first master is elected.
        """
        deadline = time.monotonic() + timeout_s
        ids: set[str] = set()
        while time.monotonic() < deadline:
            ids = set()
            for node in self.config.nodes:
                service = self.services.get(("replica", node.id))
                if service is None or service.process.poll() is not None:
                    continue
                with self.dial(node.replica_address) as channel:
                    stub = replica_pb2_grpc.ReplicaControlStub(channel)
                    try:
                        state = stub.GetReplicaState(
                            replica_pb2.GetReplicaStateRequest(), timeout=2
                        )
                    except grpc.RpcError:
                        ids.add("")
                        continue
                    ids.add(state.cluster_id)
            if len(ids) == 1 and "" not in ids:
                return ids.pop()
            time.sleep(0.05)
        raise TimeoutError(f"replicas did not agree on a cluster id: {ids}")

    def replica_role(self, node_id: str) -> int:
        """The role a node's replica reports (ROLE_UNSPECIFIED if unreachable)."""
        with self.dial(self.config.node(node_id).replica_address) as channel:
            stub = replica_pb2_grpc.ReplicaControlStub(channel)
            try:
                state = stub.GetReplicaState(replica_pb2.GetReplicaStateRequest(), timeout=2)
            except grpc.RpcError:
                return common_pb2.ROLE_UNSPECIFIED
            return int(state.role)

    def kill(self, kind: str, name: str) -> None:
        """kill -9 one service."""
        processes.kill_service(self.services[(kind, name)])

    def stop(self, kind: str, name: str) -> None:
        """Stops one service cleanly (SIGTERM)."""
        processes.stop_service(self.services[(kind, name)])

    def stop_all(self) -> None:
        """Stops every service by PID: SIGTERM to all, then waits for each (SIGKILL after
        its grace). Stopped one after the other, each coordinator waited out its server's
        full grace for peer streams that only the next ones' ends would close."""
        running = [s for s in self.services.values() if s.process.poll() is None]
        for service in running:
            service.process.terminate()
        for service in self.services.values():
            processes.stop_service(service)

    def log(self, kind: str, name: str) -> str:
        """One service's log so far."""
        return (self.run_dir / "logs" / f"{kind}-{name}.log").read_text(errors="replace")

    def channel(self, address: str | None = None) -> grpc.Channel:
        """A channel to an address (default: the gateway)."""
        return self.dial(address or self.gateway_address)


def stored_events(cluster: LocalCluster, node_id: str, topic: str) -> list[common_pb2.Event]:
    """Every committed event of a topic as one node's replica serves it, in offset order
    (read straight from the replica, not through the gateway or a client library)."""
    events: list[common_pb2.Event] = []
    with cluster.dial(cluster.replica_address(node_id)) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=topic, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=500
            ),
            timeout=30,
            metadata=cluster.metadata or None,
        )
        for response in stream:
            events.extend(response.events)
    return events


def make_cluster(template: Path, run_dir: Path, **overrides: dict[str, object]) -> LocalCluster:
    """Localizes a config template (free ports, data under run_dir) with section overrides."""
    document = tomllib.loads(template.read_text())
    for section, values in overrides.items():
        document.setdefault(section, {}).update(values)
    source = run_dir / "template.toml"
    run_dir.mkdir(parents=True, exist_ok=True)
    source.write_text(processes.dump_toml(document))
    config_path = processes.localize_config(source, run_dir)
    return LocalCluster(config_path, load_config(config_path), run_dir)


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[object]:
    """Builds clusters from deploy/ templates; every process is stopped at teardown."""
    made: list[LocalCluster] = []

    def build(template: str = "single.toml", **overrides: dict[str, object]) -> LocalCluster:
        name = re.sub(r"\W", "_", template)
        cluster = make_cluster(
            ROOT / "deploy" / template, tmp_path / f"{name}-{len(made)}", **overrides
        )
        made.append(cluster)
        return cluster

    yield build
    for cluster in made:
        cluster.stop_all()


@pytest.fixture
def single(cluster_factory: object) -> LocalCluster:
    """A running one-node cluster with its gateway."""
    cluster = cluster_factory()  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    return cluster


@pytest.fixture(scope="module")
def shared_single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A running one-node cluster shared by one module's tests that leave it serving: no
    kill, stop or damage, and topic names of their own. A test that faults a process
    takes `single` (a fresh cluster) instead."""
    cluster = make_cluster(
        ROOT / "deploy" / "single.toml", tmp_path_factory.mktemp("shared-single")
    )
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.stop_all()
