"""Traces and metrics of real Squall classes in one process, read from in-memory exporters.

Goal: a publish an app makes through the gateway is one trace — the app's call, the
gateway's forward, the master's publish and commit wait, the replication of its batch to
each slave (ended by the slave's ack) — and a subscription's deliveries are spans of the
subscriber's trace linked to the publishing trace, as are push deliveries, whose context
reaches the app; the metrics an operator watches (commit latency, events in and out,
per-replica lag, roles, store size, elections) carry the values the traffic implies; and
with telemetry off, nothing of it is even built on the publish path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

import squall
from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    coordinator_pb2_grpc,
    push_pb2,
    push_pb2_grpc,
)
from squall_server.common import grpc_tracing, telemetry
from squall_server.common.grpc_server import ServiceServer
from squall_server.coordinator.node import CoordinatorNode
from squall_server.coordinator.server import Coordinator
from squall_server.replica import server as replica_server
from squall_server.replica import telemetry as replica_telemetry
from tests.observability_harness import InProcess, Otel, cluster_config, otel, until

__all__ = ["otel"]  # the fixture, imported for pytest


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _child_of(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if _parent(s) == parent.context.span_id]


def _one(spans: list[ReadableSpan], what: str) -> ReadableSpan:
    assert len(spans) == 1, f"{what}: {[s.name for s in spans]}"
    return spans[0]


def _value(points: list[tuple[dict[str, object], object]], **attributes: object) -> object:
    matching = [v for a, v in points if all(a.get(k) == w for k, w in attributes.items())]
    assert len(matching) == 1, f"{attributes} in {points}"
    return matching[0]


def test_publish_is_one_trace_from_the_app_through_the_gateway_to_each_slaves_ack(
    otel: Otel, tmp_path: Path
) -> None:
    cluster = InProcess(cluster_config(tmp_path))
    app_tracer = otel.tracer_provider.get_tracer("app")

    def app() -> None:
        with squall.connect(
            cluster.gateway_address, tracer_provider=otel.tracer_provider
        ) as client:
            client.create_topic("orders")
            stub = broker_pb2_grpc.PublisherStub(client.channel)
            with app_tracer.start_as_current_span("app.publish"):
                stub.Publish(
                    broker_pb2.PublishRequest(
                        topic="orders",
                        events=[common_pb2.EventData(payload=b"e%d" % i) for i in range(3)],
                    ),
                    timeout=10,
                )
            with app_tracer.start_as_current_span("app.subscribe"):
                got = list(client.topic("orders").subscribe(follow=False))
            assert [m.payload for m in got] == [b"e0", b"e1", b"e2"]

    async def scenario() -> None:
        await cluster.start()
        try:
            await cluster.elect("n1")
            await asyncio.to_thread(app)
            # The slower slave's ack may come after the publisher's: wait for both.
            await until(lambda: len(otel.finished("replication.send")) >= 2, "both slaves acked")
            check_metrics()
        finally:
            await cluster.stop()

    def check_metrics() -> None:
        latency = _value(otel.points("squall.replica.commit.latency"), node="n1")
        assert latency.count == 1 and latency.sum > 0
        assert _value(otel.points("squall.replica.events.in"), node="n1") == 3
        assert _value(otel.points("squall.replica.events.out"), node="n1") == 3
        lag = otel.points("squall.replica.replication.lag")
        assert sorted(str(a["replica"]) for a, _ in lag) == ["n2", "n3"]
        assert all(a["node"] == "n1" for a, _ in lag)
        roles = otel.points("squall.replica.role")
        assert _value(roles, node="n1", role="master") == 1
        assert _value(roles, node="n1", role="slave") == 0
        assert _value(roles, node="n2", role="slave") == 1
        assert _value(otel.points("squall.replica.epoch"), node="n3") == 1
        size = _value(otel.points("squall.replica.store.size"), node="n1")
        assert isinstance(size, int) and size > 0
        changes = otel.points("squall.replica.role.changes")
        assert _value(changes, node="n1", role="master") == 1
        assert _value(changes, node="n2", role="slave") == 1
        calls = otel.points("squall.gateway.calls")
        assert _value(calls, node="g1", method="Publish", code="OK") == 1
        assert _value(calls, node="g1", method="CreateTopic", code="OK") == 1
        commit = _value(otel.points("squall.replica.commit_lsn"), node="n1")
        last = _value(otel.points("squall.replica.last_lsn"), node="n1")
        assert isinstance(commit, int) and isinstance(last, int) and 0 < commit <= last

    asyncio.run(scenario())

    spans = otel.finished()
    root = _one(otel.finished("app.publish"), "the app's span")
    in_trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
    app_call = _one(_child_of(in_trace, root), "the app's call")
    assert (app_call.name, app_call.kind) == ("squall.v1.Publisher/Publish", trace.SpanKind.CLIENT)
    gateway_server = _one(_child_of(in_trace, app_call), "the gateway's server span")
    assert gateway_server.kind == trace.SpanKind.SERVER
    forward = _one(_child_of(in_trace, gateway_server), "the forward")
    assert forward.name == "gateway.forward"
    assert forward.attributes is not None
    assert (forward.attributes["squall.master"], forward.attributes["squall.epoch"]) == ("n1", 1)
    assert forward.attributes["squall.attempts"] == 1
    attempt = _one(_child_of(in_trace, forward), "the forwarded call")
    assert attempt.kind == trace.SpanKind.CLIENT
    replica_server_span = _one(_child_of(in_trace, attempt), "the master's server span")
    assert replica_server_span.attributes is not None
    assert replica_server_span.attributes["rpc.grpc.status_code"] == 0
    publish = _one(_child_of(in_trace, replica_server_span), "the publish")
    assert publish.name == "replica.publish"
    assert publish.attributes is not None
    lsn = publish.attributes["squall.first_lsn"]
    assert publish.attributes["squall.topic"] == "orders"
    assert publish.attributes["squall.epoch"] == 1
    assert publish.attributes["squall.events"] == 3
    assert publish.attributes["squall.first_offset"] == 0
    # Epoch start and the topic's creation come first.
    assert isinstance(lsn, int) and lsn >= 3
    commit_wait = _one(_child_of(in_trace, publish), "the commit wait")
    assert commit_wait.name == "replica.commit_wait"
    assert commit_wait.attributes is not None and commit_wait.attributes["squall.lsn"] == lsn
    sends = _child_of(in_trace, commit_wait)
    assert sorted(str((s.attributes or {})["squall.replica"]) for s in sends) == ["n2", "n3"]
    for send in sends:
        attributes = send.attributes or {}
        assert send.name == "replication.send"
        assert attributes["squall.node"] == "n1" and attributes["squall.epoch"] == 1
        first, last = attributes["squall.first_lsn"], attributes["squall.last_lsn"]
        assert isinstance(first, int) and isinstance(last, int) and first <= lsn <= last
        acked = attributes["squall.acked_lsn"]
        assert isinstance(acked, int) and acked >= last
        assert [e.name for e in send.events] == ["received"]
        assert send.status.status_code != trace.StatusCode.ERROR

    subscribe_root = _one(otel.finished("app.subscribe"), "the subscriber's span")
    deliveries = [
        s
        for s in otel.finished("subscribe.deliver")
        if s.context.trace_id == subscribe_root.context.trace_id
    ]
    delivery = _one(deliveries, "one delivery of three events")
    assert delivery.attributes is not None
    assert (delivery.attributes["squall.events"], delivery.attributes["squall.first_offset"]) == (
        3,
        0,
    )
    assert delivery.attributes["squall.node"] == "n1"
    server_span = next(s for s in spans if s.context.span_id == _parent(delivery))
    assert (server_span.name, server_span.kind) == (
        "squall.v1.Subscriber/Subscribe",
        trace.SpanKind.SERVER,
    )
    # It links to the publish that stored its events (issue 20): the publisher's trace.
    assert [link.context.span_id for link in delivery.links] == [publish.context.span_id]
    assert delivery.links[0].context.trace_id == root.context.trace_id


class _App(push_pb2_grpc.PushSubscriberServicer):
    """An app's push endpoint that keeps the trace headers of each delivery."""

    def __init__(self) -> None:
        self.traceparents: list[str] = []

    def Deliver(
        self, request: push_pb2.PushDeliverRequest, context: grpc.ServicerContext
    ) -> push_pb2.PushDeliverResponse:
        if request.events:
            headers = dict(context.invocation_metadata())
            self.traceparents.append(str(headers.get("traceparent", "")))
        return push_pb2.PushDeliverResponse()


def test_a_push_delivery_is_traced_linked_to_the_publish_and_its_context_reaches_the_app(
    otel: Otel, tmp_path: Path
) -> None:
    """push.deliver: one PRODUCER span per Deliver call on the master, linked to the trace
    that published its events; its context is the call's traceparent, so an app that
    traces continues it."""
    cluster = InProcess(cluster_config(tmp_path, ["n1"]))
    app_tracer = otel.tracer_provider.get_tracer("app")
    endpoint = _App()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    push_pb2_grpc.add_PushSubscriberServicer_to_server(endpoint, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def app() -> None:
        with squall.connect(
            cluster.gateway_address, tracer_provider=otel.tracer_provider
        ) as client:
            client.create_topic("orders")
            client.topic("orders").subscribe_push("app-1", f"127.0.0.1:{port}", start="earliest")
            stub = broker_pb2_grpc.PublisherStub(client.channel)
            with app_tracer.start_as_current_span("app.publish"):
                stub.Publish(
                    broker_pb2.PublishRequest(
                        topic="orders", events=[common_pb2.EventData(payload=b"p")] * 2
                    ),
                    timeout=10,
                )

    async def scenario() -> None:
        await cluster.start()
        try:
            await cluster.elect("n1")
            await asyncio.to_thread(app)
            await until(lambda: otel.finished("push.deliver"), "a push delivery")
        finally:
            await cluster.stop()
            server.stop(None)

    asyncio.run(scenario())
    root = _one(otel.finished("app.publish"), "the app's span")
    in_trace = [s for s in otel.finished() if s.context.trace_id == root.context.trace_id]
    publish = _one([s for s in in_trace if s.name == "replica.publish"], "the publish")
    delivery = _one(otel.finished("push.deliver"), "one push delivery")
    assert delivery.kind == trace.SpanKind.PRODUCER
    attributes = delivery.attributes or {}
    assert attributes["squall.subscriber"] == "app-1" and attributes["squall.topic"] == "orders"
    assert (attributes["squall.first_offset"], attributes["squall.events"]) == (0, 2)
    assert attributes["rpc.grpc.status_code"] == 0
    assert [link.context.span_id for link in delivery.links] == [publish.context.span_id]
    # The app received the delivery's own context (trace id and span id).
    [traceparent] = endpoint.traceparents
    assert traceparent.split("-")[1:3] == [
        f"{delivery.context.trace_id:032x}",
        f"{delivery.context.span_id:016x}",
    ]


def test_a_refused_publish_ends_its_spans_with_the_error(otel: Otel, tmp_path: Path) -> None:
    cluster = InProcess(cluster_config(tmp_path, ["n1"]))

    def app() -> str:
        with squall.connect(cluster.gateway_address, retry_attempts_max=1) as client:
            stub = broker_pb2_grpc.PublisherStub(client.channel)
            try:
                stub.Publish(broker_pb2.PublishRequest(topic="missing"), timeout=5)
            except Exception as exc:  # the RpcError the app sees
                return type(exc).__name__
        return "no error"

    async def scenario() -> str:
        await cluster.start()
        try:
            await cluster.elect("n1")
            return await asyncio.to_thread(app)
        finally:
            await cluster.stop()

    assert asyncio.run(scenario()) != "no error"
    forward = _one(otel.finished("gateway.forward"), "the forward")
    assert forward.status.status_code == trace.StatusCode.ERROR
    assert forward.attributes is not None
    assert forward.attributes["rpc.grpc.status_code"] == 5  # NOT_FOUND
    servers = [
        s for s in otel.finished("squall.v1.Publisher/Publish") if s.kind == trace.SpanKind.SERVER
    ]
    # NOT_FOUND is the caller's problem: recorded, not an error of the server.
    assert sorted((s.attributes or {})["rpc.grpc.status_code"] for s in servers) == [5, 5]
    assert all(s.status.status_code != trace.StatusCode.ERROR for s in servers)
    assert otel.points("squall.replica.events.in") == []


def test_with_telemetry_off_the_publish_path_builds_no_telemetry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    telemetry.uninstall()

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("telemetry object built while telemetry is off")

    monkeypatch.setattr(replica_server, "PublishWatch", refuse)
    monkeypatch.setattr(replica_server, "DeliveryWatch", refuse)
    monkeypatch.setattr(replica_telemetry.ReplicationTracer, "__init__", refuse)
    assert grpc_tracing.server_interceptors() == []
    assert grpc_tracing.client_interceptors() == []
    cluster = InProcess(cluster_config(tmp_path))

    def app() -> list[bytes]:
        with squall.connect(cluster.gateway_address) as client:
            client.create_topic("plain")
            topic = client.topic("plain")
            with topic.publisher() as publisher:
                publisher.publish_many([b"a", b"b"])
            return [m.payload for m in topic.subscribe(follow=False)]

    async def scenario() -> list[bytes]:
        await cluster.start()
        try:
            await cluster.elect("n1")
            assert not cluster.nodes["n1"].telemetry.active
            return await asyncio.to_thread(app)
        finally:
            await cluster.stop()

    assert asyncio.run(scenario()) == [b"a", b"b"]


def test_coordinator_counts_its_election_and_reports_its_state(otel: Otel, tmp_path: Path) -> None:
    config = cluster_config(tmp_path, ["n1"])
    node_config = config.node("n1")
    node_config.data_dir.mkdir(parents=True)
    cluster = InProcess(config)

    async def scenario() -> None:
        await cluster.start()
        coordinator = CoordinatorNode(config, node_config)
        grpc_server = ServiceServer(
            node_config.coordinator_address, [], config.limits.max_message_bytes
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            Coordinator(coordinator), grpc_server.server
        )
        await grpc_server.start()
        await coordinator.start()
        try:
            await until(
                lambda: cluster.nodes["n1"].role == common_pb2.ROLE_MASTER, "n1 elected master"
            )
            epoch = coordinator.status().epoch
            states = otel.points("squall.coordinator.state")
            assert _value(states, node="n1", state="normal") == 1
            assert _value(states, node="n1", state="election") == 0
            assert _value(otel.points("squall.coordinator.epoch"), node="n1") == epoch
            assert _value(otel.points("squall.coordinator.group.members"), node="n1") == 1
        finally:
            await coordinator.stop()
            await grpc_server.stop(0)
            await cluster.stop()

    asyncio.run(scenario())
    assert _value(otel.points("squall.coordinator.elections"), node="n1") == 1
    changes = otel.points("squall.coordinator.state.changes")
    assert _value(changes, node="n1", state="normal") == 1
    assert _value(otel.points("squall.replica.role.changes"), node="n1", role="master") == 1


def test_replication_spans_end_at_the_ack_or_in_error_when_the_stream_breaks(otel: Otel) -> None:
    tracer = otel.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("publish") as publish:
        write = publish.get_span_context()
    spans = replica_telemetry.ReplicationTracer(tracer, "n1", epoch=4)
    spans.sent("n2", 1, 5, 100)  # nothing traced in it: no span
    spans.note([(7, write), (8, None)])
    spans.sent("n2", 6, 8, 300)
    spans.sent("n3", 6, 8, 300)
    spans.acked("n2", received_lsn=8, durable_lsn=5)  # received, not yet written
    assert otel.finished("replication.send") == []
    spans.acked("n2", received_lsn=8, durable_lsn=8)
    spans.closed("n3", "stream to n3 broke")
    by_replica = {
        (s.attributes or {})["squall.replica"]: s for s in otel.finished("replication.send")
    }
    acked, broken = by_replica["n2"], by_replica["n3"]
    assert acked.parent is not None and acked.parent.span_id == write.span_id
    assert (acked.attributes or {})["squall.acked_lsn"] == 8
    assert [e.name for e in acked.events] == ["received"]
    assert acked.status.status_code == trace.StatusCode.UNSET
    assert broken.status.status_code == trace.StatusCode.ERROR
    assert broken.status.description == "stream to n3 broke"
    assert len(otel.finished("replication.send")) == 2


def test_coordinator_gauges_the_nodes_it_refuses_for_differing_settings(otel: Otel) -> None:
    """squall.coordinator.config.refused counts refused nodes, not differing settings."""
    from squall_server.coordinator.messages import (
        ConfigMismatch,
        ElectionStatus,
        NodeState,
        Role,
    )
    from squall_server.coordinator.telemetry import CoordinatorInstruments

    status = ElectionStatus(
        node_id="n1",
        coordinator_id="n1",
        group_name="n1:g",
        state=NodeState.NORMAL,
        group=("n2",),
        max_seen=3,
        epoch=2,
        role=Role.MASTER,
        last_change_reason="",
        priority=3,
        designated_primary=False,
        quorum_override=0,
        quorum_required=2,
        config_mismatches=(
            ConfigMismatch("n3", "durability.acks", "majority", "all"),
            ConfigMismatch("n3", "limits.max_event_bytes", "1048576", "2048"),
        ),
    )

    class Node:
        def status(self) -> ElectionStatus:
            return status

    async def scenario() -> object:
        instruments = telemetry.current().instruments("coordinator", CoordinatorInstruments)
        node = Node()
        instruments.watch(node)  # type: ignore[arg-type]
        try:
            return _value(otel.points("squall.coordinator.config.refused"), node="n1")
        finally:
            instruments.unwatch(node)  # type: ignore[arg-type]

    assert asyncio.run(scenario()) == 1
