"""The `squall` client library against a fake in-process broker.

The fake (`FakeBroker`, served by `serve_fake`) implements the public broker services and
ClusterAdmin over a tiny in-memory topic map, with the contract's observable rules:
consecutive offsets, deduplication on (publisher_id, sequence), in-order PublishStream
answers that end the stream on the first bad request, durable cursors that only move
forward, and follow/non-follow subscriptions. test_cli.py reuses it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

import squall
from squall.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
)

MAX_EVENT_BYTES = 1024


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _InlineContext:
    """Stands in for the call's context where a refusal is answered inline."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Refused(code, details)


@dataclass
class _FakeTopic:
    info: common_pb2.Topic
    events: list[common_pb2.Event] = field(default_factory=list)
    cursors: dict[str, int] = field(default_factory=dict)
    dedup: dict[tuple[str, int], common_pb2.AckReceipt] = field(default_factory=dict)


class FakeBroker(
    broker_pb2_grpc.TopicManagerServicer,
    broker_pb2_grpc.PublisherServicer,
    broker_pb2_grpc.SubscriberServicer,
    gateway_pb2_grpc.ClusterAdminServicer,
):
    """An in-memory broker that keeps the public contract's observable rules."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.topics: dict[str, _FakeTopic] = {}
        self.publish_stream_calls = 0
        self.unary_publish_calls = 0
        self.requests_seen = 0
        # Subscribe calls whose start position is resolved (a "latest" one has its offset).
        self.subscribes_started = 0
        # Requests carrying parts of several publishers (the client's shared stream).
        self.joined_requests_seen = 0
        # When set, PublishStream reads requests but answers only while the gate is open.
        self.gate: threading.Event | None = None
        # When > 0, PublishStream ends with UNAVAILABLE after answering this many requests.
        self.break_stream_after = 0
        self.status = gateway_pb2.ClusterStatus(master_id="n1", epoch=7)
        self.links: list[broker_pb2.LinkInfo] = []

    # -- TopicManager -------------------------------------------------------------------

    def CreateTopic(
        self, request: broker_pb2.CreateTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.CreateTopicResponse:
        if not request.name or "/" in request.name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad topic name {request.name!r}")
        with self.cond:
            if request.name in self.topics:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"topic {request.name} exists")
            kind = request.kind or common_pb2.TOPIC_KIND_REPLICATED
            # As the replica answers: a replicated topic's size is counted, a transient's not.
            info = common_pb2.Topic(
                name=request.name,
                kind=kind,
                created_ms=1_700_000_000_000,
                size_known=kind == common_pb2.TOPIC_KIND_REPLICATED,
            )
            self.topics[request.name] = _FakeTopic(info)
            return broker_pb2.CreateTopicResponse(topic=info)

    def _topic(self, name: str, context: grpc.ServicerContext) -> _FakeTopic:
        topic = self.topics.get(name)
        if topic is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"topic {name} does not exist")
        return topic

    def RetrieveTopic(
        self, request: broker_pb2.RetrieveTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.RetrieveTopicResponse:
        with self.cond:
            return broker_pb2.RetrieveTopicResponse(topic=self._topic(request.name, context).info)

    def ListTopics(
        self, request: broker_pb2.ListTopicsRequest, context: grpc.ServicerContext
    ) -> broker_pb2.ListTopicsResponse:
        with self.cond:
            infos = [self.topics[name].info for name in sorted(self.topics)]
            return broker_pb2.ListTopicsResponse(topics=infos)

    def DestroyTopic(
        self, request: broker_pb2.DestroyTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.DestroyTopicResponse:
        with self.cond:
            self._topic(request.name, context)
            del self.topics[request.name]
            return broker_pb2.DestroyTopicResponse()

    def LinkTopic(
        self, request: broker_pb2.LinkTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.LinkTopicResponse:
        with self.cond:
            source = self._topic(request.from_topic, context)
            link = broker_pb2.LinkInfo(
                from_topic=request.from_topic,
                to_topic=request.to_topic,
                to_cluster=request.to_cluster,
                cost=request.cost,
                start_offset=source.info.next_offset,
                next_offset=source.info.next_offset,
                created_lsn=len(self.links) + 1,
                publisher_id=f"squall-link/{len(self.links) + 1}",
            )
            self.links.append(link)
            return broker_pb2.LinkTopicResponse(link=link)

    def UnlinkTopic(
        self, request: broker_pb2.UnlinkTopicRequest, context: grpc.ServicerContext
    ) -> broker_pb2.UnlinkTopicResponse:
        with self.cond:
            key = (request.from_topic, request.to_topic, request.to_cluster)
            kept = [x for x in self.links if (x.from_topic, x.to_topic, x.to_cluster) != key]
            if len(kept) == len(self.links):
                context.abort(grpc.StatusCode.NOT_FOUND, "no such link")
            self.links = kept
            return broker_pb2.UnlinkTopicResponse()

    def GetLinkInfo(
        self, request: broker_pb2.GetLinkInfoRequest, context: grpc.ServicerContext
    ) -> broker_pb2.GetLinkInfoResponse:
        with self.cond:
            links = [x for x in self.links if not request.topic or x.from_topic == request.topic]
            return broker_pb2.GetLinkInfoResponse(links=links)

    def GetPublisher(
        self, request: broker_pb2.GetPublisherRequest, context: grpc.ServicerContext
    ) -> broker_pb2.GetPublisherResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake has no publisher proxies")

    GetNonReplicatedPublisher = GetPublisher

    # -- Publisher ----------------------------------------------------------------------

    def _apply(
        self, request: broker_pb2.PublishRequest, context: grpc.ServicerContext
    ) -> broker_pb2.PublishResponse:
        with self.cond:
            topic = self._topic(request.topic, context)
            for e in request.events:
                if len(e.key) + len(e.payload) > MAX_EVENT_BYTES:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "event over max_event_bytes")
            response = broker_pb2.PublishResponse(request_id=request.request_id)
            holders = [
                common_pb2.ReplicaDurability(node_id="n1", durability=common_pb2.SYNC_POLICY_SYNC)
            ]
            for e in request.events:
                dedup_key = (request.publisher_id, e.sequence)
                if request.publisher_id and e.sequence and dedup_key in topic.dedup:
                    original = topic.dedup[dedup_key]
                    response.receipts.add(
                        offset=original.offset,
                        lsn=original.lsn,
                        epoch=7,
                        duplicate=True,
                        master_id="n1",
                        holders=holders,
                    )
                    continue
                offset = topic.info.next_offset
                topic.info.next_offset += 1
                topic.events.append(
                    common_pb2.Event(
                        topic=request.topic,
                        offset=offset,
                        key=e.key,
                        payload=e.payload,
                        timestamp_ms=1_700_000_000_000 + offset,
                        publisher_id=request.publisher_id,
                        sequence=e.sequence,
                        lsn=offset + 1,
                        epoch=7,
                        session_token=request.session_token,
                        headers=e.headers,
                    )
                )
                receipt = response.receipts.add(
                    offset=offset, lsn=offset + 1, epoch=7, master_id="n1", holders=holders
                )
                if request.publisher_id and e.sequence:
                    topic.dedup[dedup_key] = receipt
            self.cond.notify_all()
            return response

    def Publish(
        self, request: broker_pb2.PublishRequest, context: grpc.ServicerContext
    ) -> broker_pb2.PublishResponse:
        self.unary_publish_calls += 1
        return self._apply(request, context)

    def PublishStream(
        self,
        request_iterator: Iterator[broker_pb2.PublishRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[broker_pb2.PublishResponse]:
        with self.cond:
            self.publish_stream_calls += 1
        inline = ("squall-publish-errors", "inline") in tuple(context.invocation_metadata())
        answered = 0
        for request in request_iterator:
            with self.cond:
                self.requests_seen += 1
                self.cond.notify_all()
            gate = self.gate
            if gate is not None:
                gate.wait(30)
            if self.break_stream_after and answered >= self.break_stream_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "replica went away")
            if request.parts:
                # As the master: each part is a publish of its own, answered apart.
                with self.cond:
                    self.joined_requests_seen += 1
                response = broker_pb2.PublishResponse(request_id=request.request_id)
                response.parts.extend(self._apply_inline(part) for part in request.parts)
                yield response
            elif inline:
                response = self._apply_inline(request)
                if response.HasField("error"):
                    # As the master: a failure answered inline does not echo the id.
                    response.request_id = 0
                yield response
            else:
                yield self._apply(request, context)
            answered += 1

    def _apply_inline(self, request: broker_pb2.PublishRequest) -> broker_pb2.PublishResponse:
        """A publish whose failure is answered in the response (PublishResponse.error)."""
        try:
            return self._apply(request, _InlineContext())  # type: ignore[arg-type]
        except _Refused as refused:
            return broker_pb2.PublishResponse(
                request_id=request.request_id,
                error=broker_pb2.PublishError(code=refused.code.name, message=refused.details),
            )

    # -- Subscriber ---------------------------------------------------------------------

    def Subscribe(
        self, request: broker_pb2.SubscribeRequest, context: grpc.ServicerContext
    ) -> Iterator[broker_pb2.SubscribeResponse]:
        with self.cond:
            topic = self._topic(request.topic, context)
            if request.subscription and request.subscription in topic.cursors:
                position = topic.cursors[request.subscription]
            elif request.start == broker_pb2.START_POSITION_LATEST:
                position = topic.info.next_offset
            elif request.start == broker_pb2.START_POSITION_OFFSET:
                position = request.offset
            else:
                position = topic.info.first_offset
            if request.subscription:
                topic.cursors.setdefault(request.subscription, position)
            stop = topic.info.next_offset if not request.follow else None
            self.subscribes_started += 1
        if request.end_offset:
            stop = request.end_offset if stop is None else min(stop, request.end_offset)
        batch_max = request.max_batch_events or 100
        while context.is_active():
            with self.cond:
                if request.topic not in self.topics:
                    context.abort(grpc.StatusCode.NOT_FOUND, "topic destroyed")
                end = len(topic.events) if stop is None else min(stop, len(topic.events))
                if position >= end:
                    if stop is not None:
                        return
                    self.cond.wait(0.2)
                    continue
                events = topic.events[position : min(end, position + batch_max)]
            position += len(events)
            yield broker_pb2.SubscribeResponse(events=events)

    def Ack(
        self, request: broker_pb2.AckRequest, context: grpc.ServicerContext
    ) -> broker_pb2.AckResponse:
        with self.cond:
            topic = self._topic(request.topic, context)
            if request.subscription not in topic.cursors:
                context.abort(grpc.StatusCode.NOT_FOUND, "no such subscription")
            cursor = max(topic.cursors[request.subscription], request.offset + 1)
            topic.cursors[request.subscription] = cursor
            return broker_pb2.AckResponse(cursor=cursor)

    def ListSubscriptions(
        self, request: broker_pb2.ListSubscriptionsRequest, context: grpc.ServicerContext
    ) -> broker_pb2.ListSubscriptionsResponse:
        with self.cond:
            topic = self._topic(request.topic, context)
            return broker_pb2.ListSubscriptionsResponse(
                subscriptions=[
                    broker_pb2.SubscriptionInfo(name=name, cursor=cursor)
                    for name, cursor in sorted(topic.cursors.items())
                ]
            )

    def DeleteSubscription(
        self, request: broker_pb2.DeleteSubscriptionRequest, context: grpc.ServicerContext
    ) -> broker_pb2.DeleteSubscriptionResponse:
        with self.cond:
            topic = self._topic(request.topic, context)
            if topic.cursors.pop(request.subscription, None) is None:
                context.abort(grpc.StatusCode.NOT_FOUND, "no such subscription")
            return broker_pb2.DeleteSubscriptionResponse()

    # -- ClusterAdmin -------------------------------------------------------------------

    def GetClusterStatus(
        self, request: gateway_pb2.GetClusterStatusRequest, context: grpc.ServicerContext
    ) -> gateway_pb2.ClusterStatus:
        return self.status


def serve_fake(broker: FakeBroker) -> tuple[grpc.Server, str]:
    """Starts a gRPC server for the fake on a free loopback port; returns it and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    broker_pb2_grpc.add_TopicManagerServicer_to_server(broker, server)
    broker_pb2_grpc.add_PublisherServicer_to_server(broker, server)
    broker_pb2_grpc.add_SubscriberServicer_to_server(broker, server)
    gateway_pb2_grpc.add_ClusterAdminServicer_to_server(broker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls until predicate() holds; fails the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@pytest.fixture
def broker() -> Iterator[FakeBroker]:
    fake = FakeBroker()
    server, address = serve_fake(fake)
    fake.address = address  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        if fake.gate is not None:
            fake.gate.set()
        server.stop(grace=None)


@pytest.fixture
def client(broker: FakeBroker) -> Iterator[squall.Client]:
    with squall.connect(broker.address, timeout_s=5.0) as c:  # type: ignore[attr-defined]
        yield c


@pytest.fixture
def own_streams(broker: FakeBroker) -> Iterator[squall.Client]:
    """A client whose publishers each keep a stream of their own for everything."""
    address = broker.address  # type: ignore[attr-defined]
    with squall.connect(address, timeout_s=5.0, share_publish_stream=False) as c:
        yield c


@pytest.fixture
def single_attempt(broker: FakeBroker) -> Iterator[squall.Client]:
    """A client that does not retry, for what one attempt's failure looks like."""
    address = broker.address  # type: ignore[attr-defined]
    with squall.connect(address, timeout_s=5.0, retry_attempts_max=1) as c:
        yield c


# -- topics -------------------------------------------------------------------------------


def test_topic_lifecycle(client: squall.Client) -> None:
    info = client.create_topic("orders")
    assert info == squall.TopicInfo("orders", "replicated", 0, 0, 1_700_000_000_000, 0)
    client.create_topic("alerts", kind="transient")
    assert [(t.name, t.kind) for t in client.topics()] == [
        ("alerts", "transient"),
        ("orders", "replicated"),
    ]
    assert client.topic("orders").info.name == "orders"
    client.destroy_topic("orders")
    with pytest.raises(squall.NotFound) as err:
        client.topic("orders")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert "orders" in err.value.details
    with pytest.raises(squall.NotFound):
        client.destroy_topic("orders")


def test_create_errors(client: squall.Client) -> None:
    client.create_topic("t")
    with pytest.raises(squall.AlreadyExists):
        client.create_topic("t")
    with pytest.raises(squall.InvalidArgument):
        client.create_topic("a/b")
    with pytest.raises(ValueError, match="replicated"):
        client.create_topic("u", kind="durable")


def test_unreachable_gateway_is_unavailable() -> None:
    with socket_free_port() as address, squall.connect(address, timeout_s=2.0) as c:
        with pytest.raises(squall.Unavailable):
            c.topics()


class socket_free_port:
    """A loopback address nothing listens on (the socket is bound but never listens)."""

    def __enter__(self) -> str:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self._sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


def test_status(client: squall.Client, broker: FakeBroker) -> None:
    broker.status.nodes.add(
        node_id="n1",
        coordinator_id="n1",
        group_name="n1:abc",
        state=common_pb2.NODE_STATE_NORMAL,
        group=["n2"],
        max_seen=2,
        epoch=7,
        role=common_pb2.ROLE_MASTER,
        last_change_reason="won election",
        reachable=True,
        store_state=common_pb2.STORE_STATE_DIRTY,
    )
    status = client.status()
    assert status.master_id == "n1"
    assert status.epoch == 7
    (node,) = status.nodes
    assert (node.state, node.role, node.store_state, node.group) == (
        "normal",
        "master",
        "dirty",
        ("n2",),
    )
    assert status.to_dict()["nodes"][0]["last_change_reason"] == "won election"


# -- publishing ---------------------------------------------------------------------------


def test_publish_one_and_many(client: squall.Client, broker: FakeBroker) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    with topic.publisher("app-1") as publisher:
        first = publisher.publish(b"hello", key=b"k", headers={"h": "v"})
        assert (first.offset, first.lsn, first.epoch, first.duplicate) == (0, 1, 7, False)
        assert first.master_id == "n1"
        assert first.holders == (squall.Holder("n1", "sync"),)
        receipts = publisher.publish_many(
            [b"a", (b"key", b"b"), common_pb2.EventData(payload=b"c")], batch_events=2
        )
        assert [r.offset for r in receipts] == [1, 2, 3]
        many = publisher.publish_many((b"x%d" % i for i in range(2_000)), batch_events=300)
        assert [r.offset for r in many] == list(range(4, 2_004))
        assert publisher.next_sequence == 2_005
        # publish() went on the client's shared stream, publish_many on the publisher's own.
        assert publisher.streams_opened == 2
    assert broker.publish_stream_calls == 2
    assert broker.unary_publish_calls == 0
    events = broker.topics["t"].events
    assert [e.sequence for e in events] == list(range(1, 2_005))
    assert {e.publisher_id for e in events} == {"app-1"}
    assert (events[0].key, events[0].payload) == (b"k", b"hello")
    assert dict(events[0].headers) == {"h": "v"}
    assert (events[2].key, events[2].payload) == (b"key", b"b")


def test_default_publisher_ids_differ(client: squall.Client) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    with topic.publisher() as a, topic.publisher() as b:
        assert a.publisher_id != b.publisher_id
        assert a.publish(b"1").offset == 0
        assert b.publish(b"2").offset == 1


def test_restarted_publisher_is_deduplicated(client: squall.Client, broker: FakeBroker) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    with topic.publisher("spark-task-3") as publisher:
        publisher.publish_many([b"a", b"b", b"c"])
    # A retried task reuses its id and sequences: nothing new is stored.
    with topic.publisher("spark-task-3", start_sequence=1) as again:
        receipts = again.publish_many([b"a", b"b", b"c", b"d"])
    assert [(r.offset, r.duplicate) for r in receipts] == [
        (0, True),
        (1, True),
        (2, True),
        (3, False),
    ]
    assert len(broker.topics["t"].events) == 4


def test_publish_async_and_flush(client: squall.Client, broker: FakeBroker) -> None:
    client.create_topic("t")
    with client.topic("t").publisher("p") as publisher:
        pending = [publisher.publish_async(b"e%d" % i) for i in range(1_000)]
        publisher.flush()
        assert all(f.done() for f in pending)
        assert [f.result().offset for f in pending] == list(range(1_000))
        # Interleaving with publish_many keeps sequence order on the wire.
        publisher.publish_async(b"x")
        publisher.publish_many([b"y", b"z"])
        publisher.flush()
    assert [e.sequence for e in broker.topics["t"].events] == list(range(1, 1_004))


def test_bad_event_fails_its_batch_and_publisher_recovers(
    client: squall.Client, broker: FakeBroker
) -> None:
    client.create_topic("t")
    with client.topic("t").publisher("p") as publisher:
        publisher.publish(b"ok")
        with pytest.raises(squall.InvalidArgument) as err:
            publisher.publish_many([b"fine", b"x" * (MAX_EVENT_BYTES + 1)], batch_events=1)
        assert not err.value.maybe_stored
        # The stream that failed is replaced on the next call.
        assert publisher.publish(b"after").offset == 2
        assert publisher.streams_opened == 2
    assert broker.publish_stream_calls == 2


def test_broken_stream_is_indeterminate_and_retry_is_idempotent(
    single_attempt: squall.Client, broker: FakeBroker
) -> None:
    client = single_attempt
    client.create_topic("t")
    broker.break_stream_after = 2
    topic = client.topic("t")
    with topic.publisher("p") as publisher:
        with pytest.raises(squall.Indeterminate) as err:
            publisher.publish_many([b"e%d" % i for i in range(10)], batch_events=2)
        assert err.value.maybe_stored
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    stored = len(broker.topics["t"].events)
    assert 4 <= stored < 10
    # Republishing the same events under the same id and sequences stores each once.
    broker.break_stream_after = 0
    with topic.publisher("p", start_sequence=1) as again:
        receipts = again.publish_many([b"e%d" % i for i in range(10)], batch_events=2)
    assert [r.offset for r in receipts] == list(range(10))
    assert sum(r.duplicate for r in receipts) == stored
    assert [e.payload for e in broker.topics["t"].events] == [b"e%d" % i for i in range(10)]


def test_inflight_batches_are_bounded(client: squall.Client, broker: FakeBroker) -> None:
    client.create_topic("t")
    broker.gate = threading.Event()
    publisher = client.topic("t").publisher("p", inflight_batches_max=3)
    result: list[list[squall.Receipt]] = []
    worker = threading.Thread(
        target=lambda: result.append(publisher.publish_many([b"x"] * 20, batch_events=2))
    )
    worker.start()
    # The fake reads requests ahead of answering; the client must stop at three batches.
    wait_until(lambda: broker.requests_seen >= 1)
    assert _stays(lambda: broker.requests_seen <= 3, duration_s=0.3)
    broker.gate.set()
    worker.join(10)
    assert [r.offset for r in result[0]] == list(range(20))
    publisher.close()


def test_threads_sharing_a_publisher_share_requests(
    own_streams: squall.Client, broker: FakeBroker
) -> None:
    """One-at-a-time publishes from many threads wait together while the window is full
    and go out as one request, each caller still getting its own receipt (on the
    publisher's own stream: the shared one is tested below)."""
    client = own_streams
    client.create_topic("t")
    broker.gate = threading.Event()
    publisher = client.topic("t").publisher("p", inflight_batches_max=2)
    receipts: dict[int, squall.Receipt] = {}

    def publish(index: int) -> None:
        receipts[index] = publisher.publish(b"e%d" % index)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(20)]
    threads[0].start()
    threads[1].start()
    wait_until(lambda: publisher.next_sequence == 3)
    for thread in threads[2:]:
        thread.start()
    # Every later caller waits in the publisher: the window is full.
    wait_until(lambda: publisher.next_sequence == 21)
    assert _stays(lambda: broker.requests_seen <= 2, duration_s=0.2)
    broker.gate.set()
    for thread in threads:
        thread.join(10)
    assert sorted(r.offset for r in receipts.values()) == list(range(20))
    # The 18 waiting events took one request (two at most, had a slot freed mid-way).
    assert broker.requests_seen <= 4
    stored = {e.payload: e.offset for e in broker.topics["t"].events}
    assert all(stored[b"e%d" % i] == receipts[i].offset for i in range(20))
    publisher.close()


def _stays(predicate: Callable[[], bool], duration_s: float) -> bool:
    """Checks that predicate() holds throughout a short window (a negative can only be timed)."""
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(0.01)
    return True


def test_publish_on_closed_publisher(client: squall.Client) -> None:
    client.create_topic("t")
    publisher = client.topic("t").publisher()
    publisher.close()
    with pytest.raises(ValueError, match="closed"):
        publisher.publish(b"x")


def test_missing_topic_publish_is_definite(client: squall.Client) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    client.destroy_topic("t")
    with topic.publisher() as publisher, pytest.raises(squall.NotFound):
        publisher.publish(b"x")


# -- subscribing --------------------------------------------------------------------------


def _fill(client: squall.Client, name: str, count: int) -> squall.Topic:
    client.create_topic(name)
    topic = client.topic(name)
    with topic.publisher("filler") as publisher:
        publisher.publish_many([(b"k%d" % i, b"v%d" % i) for i in range(count)])
    return topic


def test_subscribe_non_follow_ends_after_committed(client: squall.Client) -> None:
    topic = _fill(client, "t", 250)
    with topic.subscribe(follow=False, max_batch_events=64) as sub:
        messages = list(sub)
    assert [m.offset for m in messages] == list(range(250))
    first = messages[0]
    assert (first.key, first.payload, first.publisher_id, first.sequence) == (
        b"k0",
        b"v0",
        "filler",
        1,
    )
    assert (first.lsn, first.epoch, first.timestamp_ms) == (1, 7, 1_700_000_000_000)
    assert first.headers == {}
    assert first.session_token.startswith("filler/")
    with topic.subscribe(start=240, follow=False) as sub:
        assert [m.offset for m in sub] == list(range(240, 250))
    with topic.subscribe(start="latest", follow=False) as sub:
        assert list(sub) == []


def test_subscribe_follow_sees_new_events_and_close_ends_iteration(
    client: squall.Client, broker: FakeBroker
) -> None:
    topic = _fill(client, "t", 3)
    sub = topic.subscribe(start="latest")
    # "latest" is where the topic ends when the server takes the call: publish after that.
    wait_until(lambda: broker.subscribes_started == 1)
    with topic.publisher() as publisher:
        publisher.publish(b"new")
    message = next(sub)
    assert (message.offset, message.payload) == (3, b"new")
    sub.close()
    assert list(sub) == []


def test_durable_subscription_acks_move_cursor(client: squall.Client) -> None:
    topic = _fill(client, "t", 10)
    with topic.subscribe("billing", follow=False) as sub:
        for message in sub:
            if message.offset == 5:
                assert sub.ack(message) == 6
                break
    assert topic.subscriptions() == [("billing", 6)]
    with topic.subscribe("billing", follow=False) as sub:
        assert [m.offset for m in sub] == [6, 7, 8, 9]
        assert sub.ack(9) == 10
    topic.delete_subscription("billing")
    assert topic.subscriptions() == []
    with pytest.raises(squall.NotFound):
        topic.delete_subscription("billing")


def test_ack_on_non_durable_is_value_error(client: squall.Client) -> None:
    topic = _fill(client, "t", 1)
    with topic.subscribe(follow=False) as sub, pytest.raises(ValueError, match="durable"):
        sub.ack(0)


def test_subscribe_missing_topic_raises_on_iteration(client: squall.Client) -> None:
    client.create_topic("t")
    topic = client.topic("t")
    client.destroy_topic("t")
    with topic.subscribe(follow=False) as sub, pytest.raises(squall.NotFound):
        next(sub)


@pytest.mark.parametrize("start", ["first", -1, True, 1.5])
def test_subscribe_rejects_bad_start(client: squall.Client, start: object) -> None:
    topic = _fill(client, "t", 1)
    with pytest.raises(ValueError, match="start"):
        topic.subscribe(start=start)  # type: ignore[arg-type]


def test_subscription_batches(client: squall.Client) -> None:
    topic = _fill(client, "t", 10)
    with topic.subscribe(follow=False, max_batch_events=4) as sub:
        batches = [[m.offset for m in b] for b in sub.batches()]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "sent", "outcome"),
    [
        (grpc.StatusCode.OK, True, "ok"),
        (grpc.StatusCode.UNAVAILABLE, False, "definite"),
        (grpc.StatusCode.UNAVAILABLE, True, "indeterminate"),
        (grpc.StatusCode.UNKNOWN, True, "indeterminate"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, True, "indeterminate"),
        (grpc.StatusCode.INVALID_ARGUMENT, True, "definite"),
        (grpc.StatusCode.NOT_FOUND, True, "definite"),
        (grpc.StatusCode.ABORTED, True, "definite"),
    ],
)
def test_classify(code: grpc.StatusCode, sent: bool, outcome: str) -> None:
    assert squall.classify(code, sent) == outcome


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "sent", "kind"),
    [
        (grpc.StatusCode.NOT_FOUND, False, squall.NotFound),
        (grpc.StatusCode.ALREADY_EXISTS, False, squall.AlreadyExists),
        (grpc.StatusCode.INVALID_ARGUMENT, True, squall.InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False, squall.ResourceExhausted),
        (grpc.StatusCode.PERMISSION_DENIED, False, squall.PermissionDenied),
        (grpc.StatusCode.UNAUTHENTICATED, False, squall.Unauthenticated),
        (grpc.StatusCode.FAILED_PRECONDITION, False, squall.FailedPrecondition),
        (grpc.StatusCode.UNAVAILABLE, False, squall.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, False, squall.DeadlineExceeded),
        (grpc.StatusCode.UNAVAILABLE, True, squall.Indeterminate),
        (grpc.StatusCode.UNKNOWN, True, squall.Indeterminate),
        (grpc.StatusCode.DATA_LOSS, False, squall.SquallError),
    ],
)
def test_from_rpc_error(code: grpc.StatusCode, sent: bool, kind: type[squall.SquallError]) -> None:
    err = squall.from_rpc_error(_FakeRpcError(code, "why"), sent=sent)
    assert type(err) is kind
    assert (err.code, err.details) == (code, "why")
    assert err.maybe_stored is (kind is squall.Indeterminate)
    assert str(err) == f"why ({code.name})"


# -- timeouts, failures and shutdown -------------------------------------------------------


def test_unanswered_publish_times_out_indeterminate(
    client: squall.Client, broker: FakeBroker
) -> None:
    client.create_topic("t")
    broker.gate = threading.Event()
    with squall.connect(client.address, timeout_s=0.3, retry_attempts_max=1) as impatient:
        publisher = impatient.topic("t").publisher("p")
        with pytest.raises(squall.Indeterminate) as err:
            publisher.publish(b"stuck")
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    broker.gate.set()
    broker.gate = None
    # Resending the same (publisher_id, sequence) on a new stream is deduplicated.
    with client.topic("t").publisher("p", start_sequence=1) as again:
        assert again.publish(b"stuck").offset == 0
    assert len(broker.topics["t"].events) == 1


def test_flush_timeout_makes_async_events_indeterminate(
    client: squall.Client, broker: FakeBroker
) -> None:
    client.create_topic("t")
    broker.gate = threading.Event()
    with squall.connect(client.address, timeout_s=0.3, retry_attempts_max=1) as impatient:
        publisher = impatient.topic("t").publisher("p")
        pending = [publisher.publish_async(b"e%d" % i) for i in range(20)]
        with pytest.raises(squall.Indeterminate):
            publisher.flush()
        wait_until(lambda: all(f.done() for f in pending))
        assert all(isinstance(f.exception(), squall.SquallError) for f in pending)
        broker.gate.set()


def test_async_futures_fail_when_stream_breaks(
    single_attempt: squall.Client, broker: FakeBroker
) -> None:
    client = single_attempt
    client.create_topic("t")
    broker.break_stream_after = 1
    publisher = client.topic("t").publisher("p")
    first = publisher.publish_async(b"first")
    assert first.result(5).offset == 0
    later = [publisher.publish_async(b"x") for _ in range(5)]
    publisher.flush()
    errors = [f.exception() for f in later]
    for e in errors:
        # Sent ones may have landed; unsent ones are definitely not stored.
        assert isinstance(e, squall.SquallError)
        assert e.maybe_stored or e.code == grpc.StatusCode.CANCELLED
    publisher.close()


def test_client_close_closes_publishers_and_subscriptions(
    client: squall.Client, broker: FakeBroker
) -> None:
    topic = _fill(client, "t", 3)
    publisher = topic.publisher()
    publisher.publish(b"x")
    subscription = topic.subscribe()
    assert next(subscription).offset == 0
    client.close()
    assert subscription.closed
    with pytest.raises(ValueError, match="closed"):
        publisher.publish(b"y")
    with pytest.raises(ValueError, match="closed"):
        client.topics()
    client.close()  # idempotent
