"""A topic's incarnation: a topic destroyed and created again starts clean.

Goal: the issue's reproduction with real processes — publish three events with a fixed
publisher id, destroy the topic, create it again, publish three new events with the same
id and sequences — stores the new events at offsets 0, 1, 2 (no `duplicate=True` receipt
for an event that is not there), through the library and through the raw gRPC API; and
with the master killed (kill -9) between the re-creation and the new publishes, and again
right after them, every acknowledged event of the new incarnation is readable where its
receipt says on every replica, and nothing of the old incarnation comes back.
"""

from __future__ import annotations

import time

import grpc
import pytest

import squall
from squall.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.integration.conftest import LocalCluster, wait_for

_RETRIED = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


def _read(cluster: LocalCluster, topic: str, address: str | None = None) -> list[common_pb2.Event]:
    """Every committed event of the topic, from earliest, through the gateway or a replica."""
    with cluster.channel(address) as channel:
        stream = broker_pb2_grpc.SubscriberStub(channel).Subscribe(
            broker_pb2.SubscribeRequest(topic=topic, start=broker_pb2.START_POSITION_EARLIEST),
            timeout=20,
        )
        return [event for response in stream for event in response.events]


def _stored(events: list[common_pb2.Event]) -> list[tuple[int, str, int, bytes]]:
    return [(e.offset, e.publisher_id, e.sequence, e.payload) for e in events]


def test_library_publisher_with_a_fixed_id_stores_again_in_a_recreated_topic(
    shared_single: LocalCluster,
) -> None:
    # Topic and publisher id of its own: the raw test below publishes as pub-fixed on the
    # same cluster, and a publisher id keeps to one topic.
    with squall.connect(shared_single.gateway_address, timeout_s=10.0) as client:
        client.create_topic("dd-library")
        old = client.topic("dd-library").publisher("pub-library")
        assert [old.publish(b"old-%d" % i).offset for i in range(3)] == [0, 1, 2]
        old.close()
        topic = client.topic("dd-library")
        topic.subscribe("billing", follow=False).close()  # a durable cursor of the old one
        client.destroy_topic("dd-library")
        client.create_topic("dd-library")
        topic = client.topic("dd-library")
        assert topic.subscriptions() == []
        publisher = topic.publisher("pub-library")
        receipts = [publisher.publish(b"new-%d" % i) for i in range(3)]
        publisher.close()
        assert [(r.offset, r.duplicate) for r in receipts] == [(0, False), (1, False), (2, False)]
        with topic.subscribe(follow=False) as subscription:
            read = [(m.offset, m.sequence, m.payload) for m in subscription]
        assert read == [(0, 1, b"new-0"), (1, 2, b"new-1"), (2, 3, b"new-2")]
        # The dedupe state is the new incarnation's: a retry is answered from it.
        again = topic.publisher("pub-library", start_sequence=2).publish(b"new-1")
        assert (again.offset, again.duplicate) == (1, True)
    assert _stored(_read(shared_single, "dd-library")) == [
        (0, "pub-library", 1, b"new-0"),
        (1, "pub-library", 2, b"new-1"),
        (2, "pub-library", 3, b"new-2"),
    ]


def _publish(
    stub: broker_pb2_grpc.PublisherStub, topic: str, payloads: list[bytes], first_sequence: int = 1
) -> broker_pb2.PublishResponse:
    """One raw Publish under pub-fixed, retried with the same request while indeterminate
    (the master deduplicates it)."""
    request = broker_pb2.PublishRequest(
        topic=topic,
        publisher_id="pub-fixed",
        events=[
            common_pb2.EventData(payload=p, sequence=first_sequence + i)
            for i, p in enumerate(payloads)
        ],
    )
    deadline = time.monotonic() + 30
    while True:  # bounded by the deadline
        try:
            response: broker_pb2.PublishResponse = stub.Publish(request, timeout=10)
            return response
        except grpc.RpcError as exc:
            if exc.code() not in _RETRIED or time.monotonic() > deadline:  # type: ignore[attr-defined]
                raise
        time.sleep(0.1)  # backoff between retries


def _topic_call(call: object, request: object) -> None:
    """A topic manager call retried while the gateway has no master (nothing was done)."""
    deadline = time.monotonic() + 30
    while True:  # bounded by the deadline
        try:
            call(request, timeout=10)  # type: ignore[operator]
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:  # type: ignore[attr-defined]
                raise
        time.sleep(0.1)


def test_raw_grpc_publish_with_the_same_ids_stores_again_in_a_recreated_topic(
    shared_single: LocalCluster,
) -> None:
    with shared_single.channel() as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        publisher = broker_pb2_grpc.PublisherStub(channel)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="dd-raw"), timeout=10)
        _publish(publisher, "dd-raw", [b"old-0", b"old-1", b"old-2"])
        topics.DestroyTopic(broker_pb2.DestroyTopicRequest(name="dd-raw"), timeout=10)
        topics.CreateTopic(broker_pb2.CreateTopicRequest(name="dd-raw"), timeout=10)
        response = _publish(publisher, "dd-raw", [b"new-0", b"new-1", b"new-2"])
        assert [(r.offset, r.duplicate) for r in response.receipts] == [
            (0, False),
            (1, False),
            (2, False),
        ]
        retry = _publish(publisher, "dd-raw", [b"new-2"], first_sequence=3)
        assert [(r.offset, r.duplicate) for r in retry.receipts] == [(2, True)]
    assert _stored(_read(shared_single, "dd-raw")) == [
        (0, "pub-fixed", 1, b"new-0"),
        (1, "pub-fixed", 2, b"new-1"),
        (2, "pub-fixed", 3, b"new-2"),
    ]


@pytest.fixture
def trio(cluster_factory: object) -> LocalCluster:
    cluster = cluster_factory("cluster.example.toml")  # type: ignore[operator]
    assert isinstance(cluster, LocalCluster)
    cluster.start_all()
    return cluster


def _rejoined(cluster: LocalCluster, node_id: str) -> None:
    wait_for(
        lambda: cluster.replica_role(node_id) in (common_pb2.ROLE_MASTER, common_pb2.ROLE_SLAVE),
        60,
        f"{node_id} rejoined the group",
    )


def test_master_killed_around_a_recreation_keeps_only_the_new_incarnation(
    trio: LocalCluster,
) -> None:
    """kill -9 of the master after the re-creation (before the new publishes), and of the
    next master right after them: every replica ends with exactly the new events, at their
    receipts' offsets, and a new master answers a retry from the new incarnation."""
    first = trio.wait_for_master()
    with trio.channel() as channel:
        topics = broker_pb2_grpc.TopicManagerStub(channel)
        publisher = broker_pb2_grpc.PublisherStub(channel)
        _topic_call(topics.CreateTopic, broker_pb2.CreateTopicRequest(name="dd"))
        _publish(publisher, "dd", [b"old-0", b"old-1", b"old-2", b"old-3"])
        _topic_call(topics.DestroyTopic, broker_pb2.DestroyTopicRequest(name="dd"))
        _topic_call(topics.CreateTopic, broker_pb2.CreateTopicRequest(name="dd"))
        trio.kill_node(first)  # between the re-creation and the new publishes
        second = trio.wait_for_master(exclude=first)
        response = _publish(publisher, "dd", [b"new-0", b"new-1", b"new-2"])
        acked = {
            r.offset: p
            for r, p in zip(response.receipts, [b"new-0", b"new-1", b"new-2"], strict=True)
        }
        assert sorted(acked) == [0, 1, 2]
        assert not any(r.duplicate for r in response.receipts)
        trio.start_node(first)
        _rejoined(trio, first)
        trio.kill_node(second)  # right after the new publishes
        third = trio.wait_for_master(exclude=second)
        retry = _publish(publisher, "dd", [b"new-1", b"new-2"], first_sequence=2)
        assert [(r.offset, r.duplicate) for r in retry.receipts] == [(1, True), (2, True)]
        # Sequence 4 was the old incarnation's last: in the new one it is a new event.
        fresh = _publish(publisher, "dd", [b"new-3"], first_sequence=4)
        assert [(r.offset, r.duplicate) for r in fresh.receipts] == [(3, False)]
    acked[3] = b"new-3"
    trio.start_node(second)
    _rejoined(trio, second)
    expected = [(offset, "pub-fixed", offset + 1, acked[offset]) for offset in range(4)]

    def every_replica_holds_the_new_incarnation_only() -> bool:
        return all(
            _stored(_read(trio, "dd", trio.replica_address(node.id))) == expected
            for node in trio.config.nodes
        )

    wait_for(every_replica_holds_the_new_incarnation_only, 60, "the new events on every replica")
    assert third != second
