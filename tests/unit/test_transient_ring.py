"""The transient topics' ring (services/replica/transient.py).

Goal: a reader gets the events still held, from where it asks or the oldest kept, and
never more keys and payloads per read than it allows (but always one event), so a
response of large transient events fits in one gRPC message as a stored topic's does.
"""

from __future__ import annotations

from squall.v1 import broker_pb2, common_pb2
from squall_server.replica.batch_bytes import framed_event_bytes
from squall_server.replica.transient import TransientTopics


def _publish(rings: TransientTopics, *payloads: bytes) -> None:
    request = broker_pb2.PublishRequest(
        topic="live", events=[common_pb2.EventData(payload=p) for p in payloads]
    )
    rings.publish(request, topic_id=1, epoch=1, now_ms=0, master_id="n1")


def test_a_read_stops_before_its_bytes_are_exceeded_but_returns_one_event() -> None:
    rings = TransientTopics(capacity_events=100)
    rings.new_epoch(1)
    first = rings.next_offset("live", topic_id=1)
    _publish(rings, b"a" * 400, b"b" * 400, b"c" * 400)
    # The byte bound counts each event as it goes on the wire (services/replica/batch_bytes.py).
    two = sum(framed_event_bytes(e.ByteSize()) for e in rings.read("live", first, 2, topic_id=1))
    read = rings.read("live", first, 10, max_bytes=two, topic_id=1)
    assert [len(e.payload) for e in read] == [400, 400]
    assert len(rings.read("live", first, 10, max_bytes=two - 1, topic_id=1)) == 1
    assert [e.offset for e in rings.read("live", first + 1, 10, max_bytes=100, topic_id=1)] == [
        first + 1
    ]
    assert len(rings.read("live", first, 10, topic_id=1)) == 3  # no byte bound
    assert len(rings.read("live", first, 2, max_bytes=10_000, topic_id=1)) == 2


def test_a_reader_behind_the_ring_skips_to_the_oldest_event_held() -> None:
    rings = TransientTopics(capacity_events=2)
    rings.new_epoch(1)
    first = rings.next_offset("live", topic_id=1)
    _publish(rings, b"1", b"2", b"3")
    assert [e.payload for e in rings.read("live", first, 10, topic_id=1)] == [b"2", b"3"]
    assert rings.read("live", first + 3, 10, topic_id=1) == []


def test_a_topic_created_again_gets_a_new_ring() -> None:
    """A reader of a destroyed incarnation never gets the new one's events, and the new
    incarnation starts with an empty ring, whether or not the old ring was dropped."""
    rings = TransientTopics(capacity_events=10)
    rings.new_epoch(1)
    first = rings.next_offset("live", topic_id=1)
    _publish(rings, b"old-1", b"old-2")
    again = broker_pb2.PublishRequest(topic="live", events=[common_pb2.EventData(payload=b"new")])
    rings.publish(again, topic_id=2, epoch=1, now_ms=0, master_id="n1")
    assert [e.payload for e in rings.read("live", first, 10, topic_id=2)] == [b"new"]
    assert [e.payload for e in rings.read("live", first, 10, topic_id=1)] == [b"old-1", b"old-2"]
    rings.drop("live")
    assert rings.read("live", first, 10, topic_id=1) == []
    assert rings.read("live", first, 10, topic_id=2) == []
