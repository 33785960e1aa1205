"""Squall services in one process, on loopback ports, for tests that read their telemetry.

Replicas (in-memory stores), their servicers and a gateway run on one event loop with
the same classes the service processes use; roles are set by hand (no coordinators: the
gateway finds the master by asking the replicas). Tests install in-memory OpenTelemetry
providers first, so every span and metric those classes record lands in them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deploy.processes import free_ports
from squall.v1 import broker_pb2_grpc, common_pb2, gateway_pb2_grpc, replica_pb2, replica_pb2_grpc
from squall_server.common import telemetry
from squall_server.common.config import ClusterConfig, GatewayConfig, NodeConfig
from squall_server.common.grpc_server import ServiceServer
from squall_server.gateway.forward import Forwarder
from squall_server.gateway.master import MasterTracker
from squall_server.gateway.server import ClusterAdmin
from squall_server.replica import push_server, replication_server, server
from squall_server.replica.assembly import build_replica_node
from squall_server.replica.node import ReplicaNode
from squall_server.replica.store import Store

HOST = "127.0.0.1"
# Roles never lapse in these tests: no coordinator renews them.
_NO_LEASE = 0
# The cluster id a coordinator would have minted and put in every role command.
_CLUSTER_ID = "c-test"


@dataclass
class Otel:
    """In-memory span exporter and metric reader, installed as Squall's telemetry."""

    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    def finished(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans, optionally only those called name."""
        return [s for s in self.spans.get_finished_spans() if name is None or s.name == name]

    def points(self, metric: str) -> list[tuple[dict[str, object], object]]:
        """(attributes, value or histogram point) of every data point of one metric."""
        data: MetricsData | None = self.reader.get_metrics_data()
        out: list[tuple[dict[str, object], object]] = []
        if data is None:
            return out
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for m in scope.metrics:
                    if m.name != metric:
                        continue
                    for point in m.data.data_points:
                        value = getattr(point, "value", point)
                        out.append((dict(point.attributes or {}), value))
        return out


@pytest.fixture
def otel() -> Iterator[Otel]:
    """Squall's telemetry into in-memory exporters for one test."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry.install(tracer_provider, meter_provider)
    try:
        yield Otel(spans, reader, tracer_provider, meter_provider)
    finally:
        telemetry.uninstall()
        tracer_provider.shutdown()
        meter_provider.shutdown()


WAIT_S = 10.0


async def until(condition: Callable[[], object], what: str) -> None:
    """Polls condition on the loop until it holds (bounded by WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S}s: {what}")
        await asyncio.sleep(0.02)


def cluster_config(tmp_path: Path, node_ids: Iterable[str] = ("n1", "n2", "n3")) -> ClusterConfig:
    """A cluster on free loopback ports (data_dirs are unused: stores are in memory)."""
    ids = list(node_ids)
    ports = iter(free_ports(2 * len(ids) + 1))  # distinct: held together while picked
    nodes = tuple(
        NodeConfig(
            id=node_id,
            priority=len(ids) - index,
            coordinator_address=f"{HOST}:{next(ports)}",
            replica_address=f"{HOST}:{next(ports)}",
            data_dir=tmp_path / node_id,
        )
        for index, node_id in enumerate(ids)
    )
    config = ClusterConfig(
        name="observed",
        nodes=nodes,
        gateways=(GatewayConfig(id="g1", address=f"{HOST}:{next(ports)}"),),
    )
    config.validate()
    return config


@dataclass
class InProcess:
    """Replicas and a gateway serving on one loop."""

    config: ClusterConfig
    nodes: dict[str, ReplicaNode] = field(default_factory=dict)
    servers: list[ServiceServer] = field(default_factory=list)
    masters: MasterTracker | None = None
    admin: ClusterAdmin | None = None

    @property
    def gateway_address(self) -> str:
        """Where apps connect."""
        return self.config.gateways[0].address

    async def start(self) -> None:
        """Starts every replica and the gateway (no roles yet)."""
        config = self.config
        for node_config in config.nodes:
            node = build_replica_node(config, node_config, Store.open_memory())
            grpc_server = ServiceServer(
                node_config.replica_address, [], config.limits.max_message_bytes
            )
            broker_pb2_grpc.add_TopicManagerServicer_to_server(
                server.TopicManager(node), grpc_server.server
            )
            broker_pb2_grpc.add_PublisherServicer_to_server(
                server.Publisher(node), grpc_server.server
            )
            broker_pb2_grpc.add_SubscriberServicer_to_server(
                server.Subscriber(node), grpc_server.server
            )
            broker_pb2_grpc.add_PushSubscriptionsServicer_to_server(
                push_server.PushSubscriptions(node), grpc_server.server
            )
            replica_pb2_grpc.add_ReplicaControlServicer_to_server(
                server.ReplicaControl(node), grpc_server.server
            )
            replica_pb2_grpc.add_ReplicationServicer_to_server(
                replication_server.Replication(node), grpc_server.server
            )
            await node.start()
            await grpc_server.start()
            self.nodes[node_config.id] = node
            self.servers.append(grpc_server)
        gateway = config.gateways[0]
        self.masters = MasterTracker(config, gateway.id, probe_timeout_s=1.0)
        self.admin = ClusterAdmin(config, self.masters, timeout_s=2.0)
        forwarder = Forwarder(
            self.masters, 5.0, master_wait_s=2.0, policy=config.retry.policy(), gateway_id="g1"
        )
        gateway_server = ServiceServer(gateway.address, [], config.limits.max_message_bytes)
        gateway_server.server.add_generic_rpc_handlers(forwarder.handlers())
        gateway_pb2_grpc.add_ClusterAdminServicer_to_server(self.admin, gateway_server.server)
        await gateway_server.start()
        self.servers.append(gateway_server)

    async def elect(self, master_id: str, epoch: int = 1) -> None:
        """Makes master_id the master of epoch and every other node its slave."""
        members = [
            common_pb2.NodeEndpoint(node_id=n.id, replica_address=n.replica_address)
            for n in self.config.nodes
        ]
        master_endpoint = next(m for m in members if m.node_id == master_id)
        for node_id, node in self.nodes.items():
            if node_id == master_id:
                continue
            await node.apply_role(
                replica_pb2.RoleCommand(
                    role=common_pb2.ROLE_SLAVE,
                    epoch=epoch,
                    master=master_endpoint,
                    seq=1,
                    lease_ms=_NO_LEASE,
                    reason="test",
                    cluster_id=_CLUSTER_ID,
                )
            )
        await self.nodes[master_id].apply_role(
            replica_pb2.RoleCommand(
                role=common_pb2.ROLE_MASTER,
                epoch=epoch,
                members=members,
                seq=1,
                lease_ms=_NO_LEASE,
                reason="test",
                cluster_id=_CLUSTER_ID,
            )
        )

    async def stop(self) -> None:
        """Stops the servers, then the nodes and the gateway's channels."""
        for grpc_server in self.servers:
            await grpc_server.stop(0)
        for node in self.nodes.values():
            await node.stop()
        if self.admin is not None:
            await self.admin.close()
        if self.masters is not None:
            await self.masters.close()
