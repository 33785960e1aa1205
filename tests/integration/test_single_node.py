"""A one-node cluster end to end through the gateway, with real processes.

Goal: what a user of a durable broker relies on — acknowledged events survive kill -9,
retries are deduplicated across restarts, bad input gets a clear status and changes
nothing — holds for the simplest deployment.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.integration.conftest import LocalCluster


def _stubs(
    channel: grpc.Channel,
) -> tuple[
    broker_pb2_grpc.TopicManagerStub, broker_pb2_grpc.PublisherStub, broker_pb2_grpc.SubscriberStub
]:
    return (
        broker_pb2_grpc.TopicManagerStub(channel),
        broker_pb2_grpc.PublisherStub(channel),
        broker_pb2_grpc.SubscriberStub(channel),
    )


def _read_all(subscriber: broker_pb2_grpc.SubscriberStub, topic: str) -> list[common_pb2.Event]:
    events: list[common_pb2.Event] = []
    for response in subscriber.Subscribe(
        broker_pb2.SubscribeRequest(topic=topic, start=broker_pb2.START_POSITION_EARLIEST),
        timeout=30,
    ):
        events.extend(response.events)
    return events


def _publish(
    publisher: broker_pb2_grpc.PublisherStub,
    topic: str,
    payloads: list[bytes],
    publisher_id: str = "",
    first_sequence: int = 1,
) -> broker_pb2.PublishResponse:
    request = broker_pb2.PublishRequest(
        topic=topic,
        publisher_id=publisher_id,
        events=[
            common_pb2.EventData(payload=p, sequence=first_sequence + i if publisher_id else 0)
            for i, p in enumerate(payloads)
        ],
    )
    response: broker_pb2.PublishResponse = publisher.Publish(request, timeout=30)
    return response


def test_publish_and_subscribe_through_the_gateway(shared_single: LocalCluster) -> None:
    with shared_single.channel() as channel:
        topics, publisher, subscriber = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="orders"), timeout=10)
        response = _publish(publisher, "orders", [b"a", b"b", b"c"])
        assert [r.offset for r in response.receipts] == [0, 1, 2]
        assert all(r.epoch >= 1 and r.lsn >= 1 for r in response.receipts)
        assert [h.node_id for h in response.receipts[0].holders] == ["n1"]
        events = _read_all(subscriber, "orders")
        assert [(e.offset, e.payload) for e in events] == [(0, b"a"), (1, b"b"), (2, b"c")]
        listed = topics.ListTopics(broker_pb2.ListTopicsRequest(), timeout=10).topics
        assert ("orders", 3) in [(t.name, t.next_offset) for t in listed]


def test_pipelined_stream_answers_every_request_in_order(shared_single: LocalCluster) -> None:
    with shared_single.channel() as channel:
        topics, publisher, subscriber = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="stream"), timeout=10)
        requests = [
            broker_pb2.PublishRequest(
                topic="stream",
                request_id=i,
                events=[common_pb2.EventData(payload=f"{i}-{j}".encode()) for j in range(10)],
            )
            for i in range(50)
        ]
        responses = list(publisher.PublishStream(iter(requests), timeout=60))
        assert [r.request_id for r in responses] == list(range(50))
        offsets = [receipt.offset for r in responses for receipt in r.receipts]
        assert offsets == list(range(500))
        events = _read_all(subscriber, "stream")
        assert events[123].payload == b"12-3"


def test_acknowledged_events_survive_kill_9_mid_flight(single: LocalCluster) -> None:
    """kill -9 the replica while publishers run: every acknowledged event is still there."""
    with single.channel() as channel:
        topics, _, _ = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="durable"), timeout=10)
    acknowledged: dict[int, bytes] = {}
    lock = threading.Lock()
    stop = threading.Event()
    first_ack = threading.Event()

    def publish_until_failure(worker: int) -> None:
        with single.channel() as channel:
            publisher = broker_pb2_grpc.PublisherStub(channel)
            for i in range(100_000):
                if stop.is_set():
                    return
                payload = f"w{worker}-{i}".encode()
                try:
                    response = _publish(publisher, "durable", [payload, payload + b"+"])
                except grpc.RpcError:
                    return  # the replica died: this publish was not acknowledged
                with lock:
                    for receipt, sent in zip(
                        response.receipts, [payload, payload + b"+"], strict=True
                    ):
                        acknowledged[receipt.offset] = sent
                first_ack.set()

    workers = [threading.Thread(target=publish_until_failure, args=(w,)) for w in range(3)]
    for worker in workers:
        worker.start()
    assert first_ack.wait(30), "no publish was acknowledged"
    while len(acknowledged) < 200 and all(w.is_alive() for w in workers):
        first_ack.wait(0.01)
    single.kill("replica", "n1")
    stop.set()
    for worker in workers:
        worker.join(30)
    assert len(acknowledged) >= 200
    single.start("replica", "n1")
    single.wait_for_master()

    def lost() -> dict[int, bytes]:
        with single.channel(single.replica_address("n1")) as channel:
            _, _, subscriber = _stubs(channel)
            stored = {e.offset: e.payload for e in _read_all(subscriber, "durable")}
        return {o: p for o, p in acknowledged.items() if stored.get(o) != p}

    # The last batch's commit was not recorded before the kill: the restarted master
    # hides it until its epoch's start commits, just after it takes the role.
    deadline = time.monotonic() + 10
    while (missing := lost()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not missing, f"{len(missing)} acknowledged events lost or changed: {list(missing)[:5]}"


def test_duplicate_publish_after_restart_returns_the_original_offset(single: LocalCluster) -> None:
    with single.channel() as channel:
        topics, publisher, _ = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="idem"), timeout=10)
        _publish(publisher, "idem", [b"x"])  # offset 0, no publisher id
        first = _publish(publisher, "idem", [b"one", b"two"], publisher_id="app-1")
        assert [r.offset for r in first.receipts] == [1, 2]
    single.kill("replica", "n1")
    single.start("replica", "n1")
    single.wait_for_master()
    with single.channel() as channel:
        _, publisher, subscriber = _stubs(channel)
        again = _publish(publisher, "idem", [b"one", b"two"], publisher_id="app-1")
        assert [(r.offset, r.duplicate) for r in again.receipts] == [(1, True), (2, True)]
        assert [e.payload for e in _read_all(subscriber, "idem")] == [b"x", b"one", b"two"]
        more = _publish(publisher, "idem", [b"three"], publisher_id="app-1", first_sequence=3)
        assert [(r.offset, r.duplicate) for r in more.receipts] == [(3, False)]


def test_durable_subscription_resumes_from_its_acked_cursor(single: LocalCluster) -> None:
    with single.channel() as channel:
        topics, publisher, subscriber = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="jobs"), timeout=10)
        _publish(publisher, "jobs", [f"job{i}".encode() for i in range(10)])
        request = broker_pb2.SubscribeRequest(topic="jobs", subscription="worker")
        first = [e for r in subscriber.Subscribe(request, timeout=10) for e in r.events]
        assert len(first) == 10
        reply = subscriber.Ack(
            broker_pb2.AckRequest(topic="jobs", subscription="worker", offset=3), timeout=10
        )
        assert reply.cursor == 4
    single.kill("replica", "n1")  # the cursor is durable once Ack answered
    single.start("replica", "n1")
    single.wait_for_master()
    with single.channel() as channel:
        _, _, subscriber = _stubs(channel)
        resumed = [e.offset for r in subscriber.Subscribe(request, timeout=10) for e in r.events]
        assert resumed == list(range(4, 10))
        listed = subscriber.ListSubscriptions(
            broker_pb2.ListSubscriptionsRequest(topic="jobs"), timeout=10
        )
        assert [(s.name, s.cursor) for s in listed.subscriptions] == [("worker", 4)]


def test_following_subscriber_sees_new_events(shared_single: LocalCluster) -> None:
    with shared_single.channel() as channel:
        topics, publisher, subscriber = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="live"), timeout=10)
        stream = subscriber.Subscribe(
            broker_pb2.SubscribeRequest(
                topic="live", start=broker_pb2.START_POSITION_LATEST, follow=True
            ),
            timeout=30,
        )
        _publish(publisher, "live", [b"late"])
        event = next(iter(stream)).events[0]
        stream.cancel()
        assert (event.offset, event.payload) == (0, b"late")


@pytest.mark.parametrize(
    ("call", "code", "words"),
    [
        ("retrieve_missing", grpc.StatusCode.NOT_FOUND, "topic 'nope' does not exist"),
        ("create_twice", grpc.StatusCode.ALREADY_EXISTS, "already exists"),
        ("bad_name", grpc.StatusCode.INVALID_ARGUMENT, "bad name!"),
        ("oversized", grpc.StatusCode.INVALID_ARGUMENT, "max_event_bytes is 1048576"),
        ("publish_missing", grpc.StatusCode.NOT_FOUND, "topic 'nope' does not exist"),
        ("ack_unknown", grpc.StatusCode.NOT_FOUND, "subscription 'ghost'"),
    ],
)
def test_bad_input_gets_a_clear_status_and_changes_nothing(
    shared_single: LocalCluster, call: str, code: grpc.StatusCode, words: str
) -> None:
    # The cases share one cluster, each with its own topic.
    t = f"t-{call.replace('_', '-')}"
    with shared_single.channel() as channel:
        topics, publisher, subscriber = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name=t), timeout=10)
        _publish(publisher, t, [b"keep"])
        before = topics.ListTopics(broker_pb2.ListTopicsRequest(), timeout=10).topics
        assert (t, 1) in [(topic.name, topic.next_offset) for topic in before]
        calls = {
            "retrieve_missing": lambda: topics.RetrieveTopic(
                broker_pb2.RetrieveTopicRequest(name="nope"), timeout=10
            ),
            "create_twice": lambda: topics.CreateTopic(
                broker_pb2.CreateTopicRequest(name=t), timeout=10
            ),
            "bad_name": lambda: topics.CreateTopic(
                broker_pb2.CreateTopicRequest(name="bad name!"), timeout=10
            ),
            "oversized": lambda: _publish(publisher, t, [b"ok", b"x" * (1024 * 1024 + 1)]),
            "publish_missing": lambda: _publish(publisher, "nope", [b"x"]),
            "ack_unknown": lambda: subscriber.Ack(
                broker_pb2.AckRequest(topic=t, subscription="ghost", offset=0), timeout=10
            ),
        }
        with pytest.raises(grpc.RpcError) as raised:
            calls[call]()
        assert raised.value.code() == code
        assert words in (raised.value.details() or "")
        after = topics.ListTopics(broker_pb2.ListTopicsRequest(), timeout=10).topics
        assert list(after) == list(before)
        assert [e.payload for e in _read_all(subscriber, t)] == [b"keep"]


def test_map_full_is_resource_exhausted_and_the_store_keeps_serving(
    cluster_factory: object,
) -> None:
    cluster = cluster_factory(  # type: ignore[operator]
        limits={"map_size_bytes": 2 * 1024 * 1024, "max_batch_bytes": 1024 * 1024}
    )
    cluster.start_all()
    with cluster.channel() as channel:
        topics, publisher, subscriber = _stubs(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="big"), timeout=10)
        stored = 0
        with pytest.raises(grpc.RpcError) as raised:
            for _ in range(100):
                _publish(publisher, "big", [b"y" * 200_000])
                stored += 1
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "full" in (raised.value.details() or "")
        assert stored >= 1
        events = _read_all(subscriber, "big")
        assert len(events) == stored
        # Smaller writes still fit, and reads still work.
        _publish(publisher, "big", [b"small"])
        assert _read_all(subscriber, "big")[-1].payload == b"small"


def test_health_and_reflection_answer_on_every_service(shared_single: LocalCluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for address in (shared_single.gateway_address, shared_single.replica_address("n1")):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(
                health_pb2.HealthCheckRequest(service="squall.v1.Publisher"), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert {
                "squall.v1.Publisher",
                "squall.v1.TopicManager",
                "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection",
            } <= names
            # Reflection v1 (what grpcurl and grpc-java ask for first): same messages.
            v1 = channel.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            request = reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="squall.v1.Subscriber"
            )
            (answer,) = list(v1(iter([request]), timeout=5))
            files = answer.file_descriptor_response.file_descriptor_proto
            assert any(b"squall/v1/broker.proto" in f for f in files)
