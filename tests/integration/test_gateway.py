"""The gateway follows the group view and retries indeterminate calls safely (issue 5, 2-3).

Two settings, both with a real gateway process:

* Scripted nodes: the gateway in front of in-process fake coordinators (which stream the
  group views a test sets) and fake replicas (which store a publish and then lose the
  answer, refuse definitely, or redirect as a slave). Goal: each retry rule of
  `squall_server.gateway.retry` holds on the wire, and the master comes from the watch.
* A real three-node cluster (deploy/cluster.example.toml): kill -9 the master while
  publishers with a publisher id publish through the gateway. Goal: the gateway switches
  to the new master because the group view says so (its log line), and every publish the
  app saw succeed is stored exactly once on the new master, with no duplicate anywhere.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

import squall
from deploy import processes
from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
)
from tests.integration.conftest import LocalCluster
from tests.integration.conftest import wait_for as _wait_for

NORMAL = common_pb2.NODE_STATE_NORMAL
ELECTION = common_pb2.NODE_STATE_ELECTION


def _stays(condition: Callable[[], bool], duration_s: float) -> bool:
    """True if condition holds throughout a short window (a negative can only be timed)."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        if not condition():
            return False
        time.sleep(0.01)
    return True


# =========================================================================== scripted nodes


@dataclass
class _Step:
    """What a fake replica does with one call: store first or not, then fail with code."""

    code: grpc.StatusCode | None
    store: bool = False
    redirect_to: str = ""
    # Held until set before anything else (bounded): the request stays unanswered.
    hold: threading.Event | None = None


@dataclass
class FakeReplica(broker_pb2_grpc.PublisherServicer, broker_pb2_grpc.TopicManagerServicer):
    """A replica that deduplicates publishes and fails calls as its script says."""

    node_id: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    script: collections.deque[_Step] = field(default_factory=collections.deque)
    attempts: collections.Counter[str] = field(default_factory=collections.Counter)
    stored: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    events: list[tuple[str, int]] = field(default_factory=list)
    topics: set[str] = field(default_factory=set)

    def _step(self, method: str) -> _Step | None:
        with self.lock:
            self.attempts[method] += 1
            step = self.script.popleft() if self.script else None
        if step is not None and step.hold is not None:
            assert step.hold.wait(20), "a held request was never released"
        return None if step is None or step.code is None else step

    @staticmethod
    def _fail(context: grpc.ServicerContext, step: _Step) -> None:
        if step.redirect_to:
            context.set_trailing_metadata((("squall-master-address", step.redirect_to),))
        context.abort(step.code, f"scripted {step.code.name}")

    def Publish(
        self, request: broker_pb2.PublishRequest, context: grpc.ServicerContext
    ) -> broker_pb2.PublishResponse:
        step = self._step("Publish")
        if step is not None and not step.store:
            self._fail(context, step)
        response = self._store(request)
        if step is not None:
            self._fail(context, step)
        return response

    def PublishStream(
        self,
        requests: Iterator[broker_pb2.PublishRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[broker_pb2.PublishResponse]:
        # The gateway sends a deduplicated unary publish as one request of a stream it
        # shares between callers: the script applies to each request as to a unary call,
        # and a failure ends the stream, as the real master's does.
        with self.lock:
            self.attempts["streams opened"] += 1
        for request in requests:
            step = self._step("Publish")
            if step is not None and not step.store:
                self._fail(context, step)
            response = self._store(request)
            if step is not None:
                self._fail(context, step)
            yield response

    def _store(self, request: broker_pb2.PublishRequest) -> broker_pb2.PublishResponse:
        response = broker_pb2.PublishResponse(request_id=request.request_id)
        if request.parts:  # joined: each part as a request of its own, as the master does
            with self.lock:
                self.attempts["joined"] += 1
            response.parts.extend(self._store(part) for part in request.parts)
            return response
        with self.lock:
            for event in request.events:
                key = (request.publisher_id, event.sequence)
                if request.publisher_id and event.sequence and key in self.offsets:
                    response.receipts.add(offset=self.offsets[key], duplicate=True)
                    continue
                offset = len(self.events)
                self.events.append(key)
                self.stored[key] += 1
                if request.publisher_id and event.sequence:
                    self.offsets[key] = offset
                response.receipts.add(offset=offset, master_id=self.node_id)
        return response

    def CreateTopic(
        self, request: broker_pb2.CreateTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.CreateTopicResponse:
        step = self._step("CreateTopic")
        if step is not None and not step.store:
            self._fail(context, step)
        with self.lock:
            if request.name in self.topics:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"topic {request.name} exists")
            self.topics.add(request.name)
        if step is not None:
            self._fail(context, step)
        return broker_pb2.CreateTopicResponse(topic=common_pb2.Topic(name=request.name))

    def RetrieveTopic(
        self, request: broker_pb2.RetrieveTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.RetrieveTopicResponse:
        step = self._step("RetrieveTopic")
        if step is not None:
            self._fail(context, step)
        return broker_pb2.RetrieveTopicResponse(topic=common_pb2.Topic(name=request.name))


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Streams whatever group view the test sets, to every watcher."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.view = coordinator_pb2.GroupView()
        self.version = 0
        self.watchers = 0

    def set_view(self, view: coordinator_pb2.GroupView) -> None:
        with self.cond:
            self.view = view
            self.version += 1
            self.cond.notify_all()

    def WatchGroupView(
        self, request: coordinator_pb2.WatchGroupViewRequest, context: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.GroupView]:
        seen = -1
        with self.cond:
            self.watchers += 1
        try:
            for _ in range(1_000_000):  # bounded; ends when the gateway goes
                if not context.is_active():
                    return
                with self.cond:
                    if self.version == seen:
                        self.cond.wait(0.1)
                        continue
                    seen, view = self.version, coordinator_pb2.GroupView()
                    view.CopyFrom(self.view)
                yield view
        finally:
            with self.cond:
                self.watchers -= 1


def _gauge(port: int, name: str) -> float | None:
    """A gauge scraped from a Prometheus endpoint on this host (None: not reported)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        for line in page.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


@dataclass
class ScriptedCluster:
    """Two fake nodes (coordinator + replica each) behind a real gateway process."""

    replicas: dict[str, FakeReplica]
    coordinators: dict[str, FakeCoordinator]
    addresses: dict[str, str]  # node id -> replica address
    gateway: processes.Service
    metrics_port: int

    def gauge(self, name: str) -> float | None:
        """A gauge of the gateway's (None: not reported)."""
        return _gauge(self.metrics_port, name)

    def views(self, state: int, epoch: int, master: str = "", nodes: tuple[str, ...] = ()) -> None:
        """Every (or the named) fake coordinator reports this view of its own node."""
        for node_id in nodes or tuple(self.coordinators):
            view = coordinator_pb2.GroupView(node_id=node_id, state=state, epoch=epoch)
            if master:
                view.master.node_id = master
                view.master.replica_address = self.addresses[master]
            self.coordinators[node_id].set_view(view)

    def log(self) -> str:
        return self.gateway.log_path.read_text(errors="replace")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.gateway.address)


def _serve(*servicers: object) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    for servicer in servicers:
        if isinstance(servicer, FakeReplica):
            broker_pb2_grpc.add_PublisherServicer_to_server(servicer, server)
            broker_pb2_grpc.add_TopicManagerServicer_to_server(servicer, server)
        elif isinstance(servicer, FakeCoordinator):
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[ScriptedCluster]:
    servers: list[grpc.Server] = []
    replicas, coordinators, addresses, nodes = {}, {}, {}, []
    for priority, node_id in ((2, "n1"), (1, "n2")):
        replicas[node_id] = FakeReplica(node_id)
        coordinators[node_id] = FakeCoordinator()
        replica_server, replica_address = _serve(replicas[node_id])
        coordinator_server, coordinator_address = _serve(coordinators[node_id])
        servers += [replica_server, coordinator_server]
        addresses[node_id] = replica_address
        nodes.append(
            {
                "id": node_id,
                "priority": priority,
                "coordinator_address": coordinator_address,
                "replica_address": replica_address,
                "data_dir": str(tmp_path / "data" / node_id),
            }
        )
    gateway_port, prometheus_port = processes.free_ports(2)  # together: distinct
    gateway_address = f"127.0.0.1:{gateway_port}"
    document = {
        "cluster": {"name": "scripted"},
        "nodes": nodes,
        "gateways": [{"id": "g1", "address": gateway_address}],
        "timeouts": {"rpc_timeout_ms": 1500, "publish_timeout_ms": 3000},
        "retry": {"retry_backoff_initial_ms": 5, "retry_backoff_max_ms": 50},
        # Its gauges say what waits at the gateway (a test waits on them, not on time).
        "telemetry": {
            "exporter": "prometheus",
            "prometheus_host": "127.0.0.1",
            "gateway_prometheus_port": prometheus_port,
        },
    }
    config_path = tmp_path / "scripted.toml"
    config_path.write_text(processes.dump_toml(document))
    gateway = processes.start_service(
        "gateway", config_path, "g1", gateway_address, tmp_path / "gateway.log"
    )
    try:
        processes.wait_serving([gateway])
        metrics_port = int(document["telemetry"]["gateway_prometheus_port"])  # type: ignore[index]
        cluster = ScriptedCluster(replicas, coordinators, addresses, gateway, metrics_port)
        cluster.views(NORMAL, 1, master="n1")
        _wait_for(lambda: "master is n1" in cluster.log(), 10, "the gateway follows n1")
        yield cluster
    finally:
        processes.stop_service(gateway)
        for server in servers:
            server.stop(grace=None)


def _publish(
    channel: grpc.Channel, publisher_id: str, *sequences: int, timeout_s: float = 10
) -> broker_pb2.PublishResponse:
    request = broker_pb2.PublishRequest(topic="t", publisher_id=publisher_id)
    for sequence in sequences:
        request.events.add(payload=b"x", sequence=sequence)
    response: broker_pb2.PublishResponse = broker_pb2_grpc.PublisherStub(channel).Publish(
        request, timeout=timeout_s
    )
    return response


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED],
)
def test_gateway_retries_a_lost_publish_answer_and_stores_once(
    scripted: ScriptedCluster, code: grpc.StatusCode
) -> None:
    master = scripted.replicas["n1"]
    master.script.extend([_Step(code, store=True), _Step(code, store=True)])
    with scripted.channel() as channel:
        response = _publish(channel, "p", 1, 2)
    assert [r.duplicate for r in response.receipts] == [True, True]
    assert master.attempts["Publish"] == 3
    assert master.stored == {("p", 1): 1, ("p", 2): 1}
    # Each attempt was a request on the gateway's shared publish stream; each lost
    # answer ended that stream, so the next attempt went on a new one.
    assert master.attempts["streams opened"] == 3


def test_a_joined_request_whose_answer_is_lost_is_sent_again_and_stored_once(
    scripted: ScriptedCluster,
) -> None:
    # Two callers' requests go at once; the master holds the first, so six more callers
    # wait at the gateway and go, once it answers, as one joined request. The master
    # stores that request and the stream breaks before its answer (a master killed
    # mid-flight): each of the six is sent again under its ids and hears the receipt of
    # its first store.
    master = scripted.replicas["n1"]
    held = threading.Event()
    master.script.extend(
        [
            _Step(None, hold=held),
            _Step(None),
            _Step(grpc.StatusCode.UNAVAILABLE, store=True),
        ]
    )
    with scripted.channel() as channel, futures.ThreadPoolExecutor(8) as pool:
        first = [pool.submit(_publish, channel, f"p{i}", 1) for i in range(2)]
        _wait_for(lambda: master.attempts["Publish"] >= 1, 10, "the first request at the master")
        # The master reads a stream's requests in turn: the gateway's gauges say when the
        # second is written beside the first, and when the six wait behind them.
        _wait_for(
            lambda: scripted.gauge("squall_gateway_publish_unanswered") == 2,
            10,
            "two requests unanswered on the shared stream",
        )
        rest = [pool.submit(_publish, channel, f"p{i}", 1) for i in range(2, 8)]
        _wait_for(
            lambda: scripted.gauge("squall_gateway_publish_waiting") == 6,
            10,
            "six callers waiting at the gateway",
        )
        held.set()
        responses = {f"p{i}": call.result(20) for i, call in enumerate(first + rest)}
    assert master.attempts["joined"] >= 1  # the retries may or may not meet again
    assert master.stored == {(f"p{i}", 1): 1 for i in range(8)}
    for publisher, response in responses.items():
        [receipt] = response.receipts
        assert master.events[receipt.offset] == (publisher, 1)
    resent = [r for p, r in responses.items() if r.receipts[0].duplicate]
    assert len(resent) == 6, responses
    assert "1 requests unanswered, carrying 6 publishes" in scripted.log()


def test_gateway_does_not_retry_a_publish_without_sequences(scripted: ScriptedCluster) -> None:
    master = scripted.replicas["n1"]
    master.script.append(_Step(grpc.StatusCode.UNAVAILABLE, store=True))
    with scripted.channel() as channel, pytest.raises(grpc.RpcError) as err:
        _publish(channel, "p", 1, 0)  # sequence 0: the master cannot deduplicate it
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert master.attempts["Publish"] == 1


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ],
)
def test_gateway_passes_definite_failures_through_without_retrying(
    scripted: ScriptedCluster, code: grpc.StatusCode
) -> None:
    master = scripted.replicas["n1"]
    master.script.append(_Step(code))
    with scripted.channel() as channel, pytest.raises(grpc.RpcError) as err:
        _publish(channel, "p", 1)
    assert err.value.code() == code  # type: ignore[attr-defined]
    assert err.value.details() == f"scripted {code.name}"  # type: ignore[attr-defined]
    assert master.attempts["Publish"] == 1
    assert not master.stored


def test_definite_answer_after_a_lost_one_is_reported_unknown(scripted: ScriptedCluster) -> None:
    master = scripted.replicas["n1"]
    master.script.extend(
        [_Step(grpc.StatusCode.UNAVAILABLE, store=True), _Step(grpc.StatusCode.NOT_FOUND)]
    )
    with scripted.channel() as channel, pytest.raises(grpc.RpcError) as err:
        _publish(channel, "p", 1)
    assert err.value.code() == grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    assert "an earlier attempt may have been applied" in err.value.details()  # type: ignore[attr-defined]
    assert master.stored == {("p", 1): 1}


def test_create_topic_is_not_retried_on_an_unknown_outcome(scripted: ScriptedCluster) -> None:
    master = scripted.replicas["n1"]
    master.script.append(_Step(grpc.StatusCode.UNKNOWN, store=True))
    with scripted.channel() as channel, pytest.raises(grpc.RpcError) as err:
        broker_pb2_grpc.TopicManagerStub(channel).CreateTopic(
            broker_pb2.CreateTopicRequest(name="t"), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    assert master.attempts["CreateTopic"] == 1
    assert master.topics == {"t"}


def test_reads_are_retried(scripted: ScriptedCluster) -> None:
    master = scripted.replicas["n1"]
    master.script.extend([_Step(grpc.StatusCode.UNAVAILABLE)] * 2)
    with scripted.channel() as channel:
        response = broker_pb2_grpc.TopicManagerStub(channel).RetrieveTopic(
            broker_pb2.RetrieveTopicRequest(name="t"), timeout=10
        )
    assert response.topic.name == "t"
    assert master.attempts["RetrieveTopic"] == 3


def test_a_slaves_redirect_is_followed_even_for_create_topic(scripted: ScriptedCluster) -> None:
    # The views still say n2 is master, but n2 already follows n1 and says so.
    scripted.views(NORMAL, 2, master="n2")
    _wait_for(lambda: "master is n2" in scripted.log(), 10, "the gateway follows n2")
    slave, master = scripted.replicas["n2"], scripted.replicas["n1"]
    slave.script.append(_Step(grpc.StatusCode.UNAVAILABLE, redirect_to=scripted.addresses["n1"]))
    with scripted.channel() as channel:
        broker_pb2_grpc.TopicManagerStub(channel).CreateTopic(
            broker_pb2.CreateTopicRequest(name="t"), timeout=10
        )
    assert (slave.attempts["CreateTopic"], master.attempts["CreateTopic"]) == (1, 1)
    assert (slave.topics, master.topics) == (set(), {"t"})


def test_the_master_switch_comes_from_the_watch(scripted: ScriptedCluster) -> None:
    with scripted.channel() as channel:
        assert _publish(channel, "p", 1).receipts[0].master_id == "n1"
        # n1 loses its group; n2 leads epoch 2.
        scripted.views(ELECTION, 1, nodes=("n1",))
        scripted.views(NORMAL, 2, master="n2", nodes=("n2",))
        _wait_for(lambda: "master is n2" in scripted.log(), 10, "the gateway follows n2")
        assert _publish(channel, "p", 2).receipts[0].master_id == "n2"
        status = gateway_pb2_grpc.ClusterAdminStub(channel).GetClusterStatus(
            gateway_pb2.GetClusterStatusRequest(), timeout=10
        )
    assert (status.master_id, status.epoch) == ("n2", 2)
    line = next(line for line in scripted.log().splitlines() if "master is n2" in line)
    assert "from the group view of n2" in line and "epoch=2" in line
    assert "no coordinator has answered" not in scripted.log()


def test_calls_wait_for_a_master_then_go_through(scripted: ScriptedCluster) -> None:
    scripted.views(ELECTION, 1)
    _wait_for(lambda: "no master" in scripted.log(), 10, "the gateway loses its master")
    with scripted.channel() as channel:
        call = broker_pb2_grpc.PublisherStub(channel).Publish.future(
            broker_pb2.PublishRequest(
                topic="t", publisher_id="p", events=[common_pb2.EventData(sequence=1)]
            ),
            timeout=10,
        )
        # IceStorm's "Inactive": the request blocks instead of failing.
        assert _stays(lambda: not call.done(), 0.3)
        scripted.views(NORMAL, 2, master="n2")
        assert call.result(10).receipts[0].master_id == "n2"


def test_without_a_master_a_call_fails_after_a_bounded_wait(scripted: ScriptedCluster) -> None:
    scripted.views(ELECTION, 1)
    _wait_for(lambda: "no master" in scripted.log(), 10, "the gateway loses its master")
    started = time.monotonic()
    with scripted.channel() as channel, pytest.raises(grpc.RpcError) as err:
        _publish(channel, "p", 1)
    elapsed_s = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "no master" in err.value.details()  # type: ignore[attr-defined]
    # It waited for rpc_timeout_ms (1.5 s), no less and not for ever.
    assert 1.3 <= elapsed_s < 8
    assert sum(r.attempts["Publish"] for r in scripted.replicas.values()) == 0


def test_a_deposed_masters_late_view_is_ignored(scripted: ScriptedCluster) -> None:
    scripted.views(NORMAL, 3, master="n2", nodes=("n2",))
    _wait_for(lambda: "master is n2" in scripted.log(), 10, "the gateway follows n2")
    # n1 still claims epoch 1 (it has not noticed): the higher epoch stands.
    scripted.views(NORMAL, 1, master="n1", nodes=("n1",))
    with scripted.channel() as channel:
        assert _publish(channel, "p", 1).receipts[0].master_id == "n2"


# =========================================================================== real cluster


@pytest.fixture
def trio(cluster_factory: object) -> LocalCluster:
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    return cluster


class _AppPublisher(threading.Thread):
    """An app publishing one event per call through the gateway, remembering what it saw."""

    def __init__(self, publish: Callable[[int], squall.Receipt | None]) -> None:
        super().__init__(daemon=True)
        self._publish = publish
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: dict[int, squall.Receipt] = {}  # sequence -> receipt
        self.failed: dict[int, BaseException] = {}
        self.error: BaseException | None = None

    def acked_by(self, master_id: str) -> int:
        with self.lock:
            return sum(r.master_id == master_id for r in self.acked.values())

    def run(self) -> None:
        try:
            for sequence in range(1, 100_000):  # bounded; the test stops it much earlier
                if self.stop.is_set():
                    return
                try:
                    receipt = self._publish(sequence)
                except (squall.SquallError, grpc.RpcError) as exc:
                    with self.lock:
                        self.failed[sequence] = exc
                    continue
                if receipt is not None:
                    with self.lock:
                        self.acked[sequence] = receipt
        except BaseException as exc:  # reported by the test
            self.error = exc


def _stored_on(address: str, topic: str) -> collections.Counter[tuple[str, int]]:
    """How often each (publisher_id, sequence) is stored, read from one replica."""
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=topic, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=500
            ),
            timeout=20,
        )
        for response in stream:
            counts.update((e.publisher_id, e.sequence) for e in response.events)
    return counts


def _kill_master_while_publishing(trio: LocalCluster, app: _AppPublisher) -> tuple[str, str]:
    """Runs the app across a kill -9 of the master; returns (old master, new master)."""
    old = trio.wait_for_master()
    app.start()
    try:
        _wait_for(lambda: app.acked_by(old) >= 30, 20, f"30 publishes acknowledged by {old}")
        trio.kill_node(old)
        new = trio.wait_for_master(exclude=old)
        _wait_for(lambda: app.acked_by(new) >= 30, 30, f"30 publishes acknowledged by {new}")
    finally:
        app.stop.set()
        app.join(30)
    assert app.error is None, repr(app.error)
    return old, new


def _check_exactly_once(trio: LocalCluster, new: str, topic: str, app: _AppPublisher) -> None:
    """What we assert: on the new master, every (publisher_id, sequence) is stored at most
    once, and every publish the app saw succeed (acknowledged by either master: acks are
    majority-replicated) is there exactly once; a publish the app saw fail definitely is
    not there at all."""
    stored = _stored_on(trio.replica_address(new), topic)
    duplicates = {key: count for key, count in stored.items() if count > 1}
    assert not duplicates, f"stored more than once: {duplicates}"
    missing = [s for s in app.acked if stored[("app-1", s)] != 1]
    assert not missing, f"acknowledged but not stored exactly once: {missing[:20]}"
    for sequence, error in app.failed.items():
        if not getattr(error, "maybe_stored", True):
            assert stored[("app-1", sequence)] == 0, f"definite failure {sequence} was stored"


def _gateway_switched_by_the_watch(trio: LocalCluster, old: str, new: str) -> None:
    """The gateway logged the new master, from a group view, in a newer epoch."""
    _wait_for(
        lambda: f"master is {new}" in trio.log("gateway", "g1"), 10, "the gateway log names it"
    )
    log = trio.log("gateway", "g1")
    line = next(line for line in log.splitlines() if f"master is {new}" in line)
    assert "(from the group view of" in line, line
    assert "epoch=" in line and f"node={new}" in line, line
    first = next(line for line in log.splitlines() if f"master is {old}" in line)
    assert "(from the group view of" in first, first
    assert int(line.split("epoch=")[1].split()[0]) > int(first.split("epoch=")[1].split()[0])


def test_library_publisher_through_the_gateway_survives_a_master_kill_exactly_once(
    trio: LocalCluster,
) -> None:
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("orders")
        publisher = client.topic("orders").publisher("app-1")
        app = _AppPublisher(lambda sequence: publisher.publish(b"order %d" % sequence))
        old, new = _kill_master_while_publishing(trio, app)
        streams_opened = publisher.streams_opened
        publisher.close()
    _gateway_switched_by_the_watch(trio, old, new)
    _check_exactly_once(trio, new, "orders", app)
    # The master's death ended the publish stream (the gateway relays it), and the library
    # went on over a fresh one; its retries absorbed the failover: the app saw no failure.
    assert streams_opened >= 2
    assert not app.failed, {s: repr(e) for s, e in list(app.failed.items())[:5]}


def test_own_publishers_in_threads_on_the_shared_stream_survive_a_master_kill_exactly_once(
    trio: LocalCluster,
) -> None:
    # Twelve threads, each with a publisher of its own from one client, publish one event
    # at a time: their publishes share the client's one stream (joined into one request
    # while its window is full). kill -9 the master: whatever was in flight is sent again
    # under the same ids on a fresh stream, and nothing acknowledged is lost or doubled.
    with squall.connect(trio.gateway_address, timeout_s=5.0) as client:
        client.create_topic("fanin")
        topic = client.topic("fanin")
        publishers = [topic.publisher(f"thread-{i}") for i in range(12)]
        apps = [
            _AppPublisher(lambda sequence, p=p: p.publish(b"event %d" % sequence))
            for p in publishers
        ]
        old = trio.wait_for_master()
        for app in apps:
            app.start()
        try:
            _wait_for(lambda: sum(a.acked_by(old) for a in apps) >= 200, 30, "200 acks")
            trio.kill_node(old)
            new = trio.wait_for_master(exclude=old)
            _wait_for(lambda: sum(a.acked_by(new) for a in apps) >= 200, 40, "200 acks after")
        finally:
            for app in apps:
                app.stop.set()
            for app in apps:
                app.join(30)
        shared_streams = sum(p.streams_opened for p in publishers)
    assert all(app.error is None for app in apps), [repr(a.error) for a in apps if a.error]
    stored = _stored_at(trio.replica_address(new), "fanin")
    counts = collections.Counter(stored.values())
    duplicates = {key: n for key, n in counts.items() if n > 1}
    assert not duplicates, f"stored more than once: {list(duplicates.items())[:10]}"
    misplaced = {
        (p.publisher_id, sequence): (receipt.offset, stored.get(receipt.offset))
        for p, app in zip(publishers, apps, strict=True)
        for sequence, receipt in app.acked.items()
        if stored.get(receipt.offset) != (p.publisher_id, sequence)
    }
    assert not misplaced, f"not where the receipt says: {list(misplaced.items())[:10]}"
    # Each publisher's events are stored in its sequence order.
    for p in publishers:
        sequences = [key[1] for _, key in sorted(stored.items()) if key[0] == p.publisher_id]
        assert sequences == sorted(sequences), p.publisher_id
    # The kill ended the shared stream and its publishers went on over a fresh one; the
    # retries absorbed the failover.
    assert shared_streams >= 2 * len(publishers)
    failed = {s: repr(e) for app in apps for s, e in app.failed.items()}
    assert not failed, list(failed.items())[:5]


def test_unary_publishes_through_the_gateway_are_retried_by_it_exactly_once(
    trio: LocalCluster,
) -> None:
    # A raw-stub app that never retries: any publish in flight when the master dies is
    # retried by the gateway with the same (publisher_id, sequence).
    with grpc.insecure_channel(trio.gateway_address) as channel:
        broker_pb2_grpc.TopicManagerStub(channel).CreateTopic(
            broker_pb2.CreateTopicRequest(name="ledger"), timeout=10
        )
        stub = broker_pb2_grpc.PublisherStub(channel)

        def publish(sequence: int) -> squall.Receipt:
            response = stub.Publish(
                broker_pb2.PublishRequest(
                    topic="ledger",
                    publisher_id="app-1",
                    events=[common_pb2.EventData(payload=b"%d" % sequence, sequence=sequence)],
                ),
                timeout=20,
            )
            pb = response.receipts[0]
            return squall.Receipt(
                offset=pb.offset,
                lsn=pb.lsn,
                epoch=pb.epoch,
                duplicate=pb.duplicate,
                holders=(),
                master_id=pb.master_id,
            )

        app = _AppPublisher(publish)
        old, new = _kill_master_while_publishing(trio, app)
    _gateway_switched_by_the_watch(trio, old, new)
    _check_exactly_once(trio, new, "ledger", app)
    assert not app.failed, {s: repr(e) for s, e in list(app.failed.items())[:5]}


def _stored_at(address: str, topic: str) -> dict[int, tuple[str, int]]:
    """Offset -> (publisher_id, sequence) of every event of the topic, read from one replica."""
    at: dict[int, tuple[str, int]] = {}
    with grpc.insecure_channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(
                topic=topic, start=broker_pb2.START_POSITION_EARLIEST, max_batch_events=500
            ),
            timeout=20,
        )
        for response in stream:
            at.update((e.offset, (e.publisher_id, e.sequence)) for e in response.events)
    return at


def test_many_unary_callers_on_the_shared_stream_survive_a_master_kill_exactly_once(
    cluster_factory: object,
) -> None:
    # Sixteen raw-stub callers (each its own publisher id, one channel) publish one event
    # per unary call; the gateway carries them all on its one publish stream to the
    # master, joining the callers that wait into shared requests (PublishRequest.parts).
    # kill -9 the master: every publish in flight on that stream, or waiting to be
    # written, is sent again to the new master under the same ids.
    callers, topic = 16, "shared"
    acked: dict[tuple[str, int], broker_pb2.AckReceipt] = {}
    failed: dict[tuple[str, int], grpc.RpcError] = {}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    # The gateway's gauges say when every caller's publish is at the gateway, held by
    # the frozen master or waiting to be written (the test waits on them, not on time).
    trio = cluster_factory(  # type: ignore[operator]
        "cluster.example.toml", telemetry={"exporter": "prometheus"}
    )
    assert isinstance(trio, LocalCluster)
    trio.start_all()
    old = trio.wait_for_master()
    endpoint = re.search(r"metrics endpoint http://127\.0\.0\.1:(\d+)/", trio.log("gateway", "g1"))
    assert endpoint, "the gateway logged no metrics endpoint"
    metrics_port = int(endpoint.group(1))
    with grpc.insecure_channel(trio.gateway_address) as channel:
        broker_pb2_grpc.TopicManagerStub(channel).CreateTopic(
            broker_pb2.CreateTopicRequest(name=topic), timeout=10
        )
        stub = broker_pb2_grpc.PublisherStub(channel)

        def run(index: int) -> None:
            publisher_id = f"caller-{index}"
            try:
                for sequence in range(1, 100_000):  # bounded; stopped much earlier
                    if stop.is_set():
                        return
                    key = (publisher_id, sequence)
                    try:
                        response = stub.Publish(
                            broker_pb2.PublishRequest(
                                topic=topic,
                                publisher_id=publisher_id,
                                events=[common_pb2.EventData(payload=b"x", sequence=sequence)],
                            ),
                            timeout=20,
                        )
                    except grpc.RpcError as exc:
                        with lock:
                            failed[key] = exc
                        continue
                    with lock:
                        acked[key] = response.receipts[0]
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        def acked_by(master_id: str) -> int:
            with lock:
                return sum(r.master_id == master_id for r in acked.values())

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(callers)]
        for thread in threads:
            thread.start()
        try:
            _wait_for(lambda: acked_by(old) >= 200, 30, f"200 publishes acknowledged by {old}")
            # Frozen first, so that the kill finds every caller's publish on the stream
            # unanswered or waiting to be written (a kill between answers would leave
            # nothing to resend). Answers the master wrote before it froze still arrive,
            # and their callers publish again: only the gateway can say when all sixteen
            # are there.
            os.kill(trio.services[("replica", old)].process.pid, signal.SIGSTOP)

            def all_at_the_gateway() -> bool:
                held = _gauge(metrics_port, "squall_gateway_publish_in_flight")
                waiting = _gauge(metrics_port, "squall_gateway_publish_waiting")
                return (held or 0) + (waiting or 0) == callers

            _wait_for(all_at_the_gateway, 10, "every caller's publish held by the frozen master")
            trio.kill_node(old)
            new = trio.wait_for_master(exclude=old)
            _wait_for(lambda: acked_by(new) >= 200, 40, f"200 publishes acknowledged by {new}")
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
    assert not errors, repr(errors[0])
    # The kill ended the shared stream with every caller's publish unanswered or waiting
    # to be written (a joined request among them is likely, not certain: see
    # test_a_joined_request_whose_answer_is_lost_is_sent_again_and_stored_once).
    log = trio.log("gateway", "g1")
    ended = [
        sum(map(int, counts))
        for counts in re.findall(
            r"requests unanswered, carrying (\d+) publishes; (\d+) publishes not yet written",
            log,
        )
    ]
    assert callers in ended, log[-2000:]
    stored = _stored_at(trio.replica_address(new), topic)
    counts = collections.Counter(stored.values())
    duplicates = {key: n for key, n in counts.items() if n > 1}
    assert not duplicates, f"stored more than once: {list(duplicates.items())[:10]}"
    # Every acknowledged event is there once, at the offset its receipt names (a
    # duplicate receipt names the offset of the first store).
    misplaced = {
        key: (receipt.offset, stored.get(receipt.offset))
        for key, receipt in acked.items()
        if stored.get(receipt.offset) != key
    }
    assert not misplaced, f"not where the receipt says: {list(misplaced.items())[:10]}"
    # The gateway's retries absorbed the failover: no caller saw a failure.
    assert not failed, {k: repr(e) for k, e in list(failed.items())[:5]}
    assert len(acked) >= 400
