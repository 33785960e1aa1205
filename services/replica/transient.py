"""Live delivery for transient topics: events held in a bounded ring, never stored.

A transient topic's metadata is replicated like any other, but its events follow
IceStorm's model: they reach whoever is subscribed now and are gone after. A bounded
ring lets a subscriber that is briefly slower than the publishers catch up; one that
falls further behind skips ahead to the oldest event still held.

Rings are kept per topic incarnation (name and topic id): a topic destroyed and created
again under the same name gets a new ring, and a reader of the old incarnation never
sees the new one's events.
"""

from __future__ import annotations

from collections import deque

from squall.v1 import broker_pb2, common_pb2
from squall_server.replica.batch_bytes import framed_event_bytes


class _Ring:
    def __init__(self, capacity: int, first_offset: int) -> None:
        self.next_offset = first_offset
        self.events: deque[common_pb2.Event] = deque(maxlen=capacity)


class TransientTopics:
    """The in-memory rings of every transient topic on this replica."""

    def __init__(self, capacity_events: int) -> None:
        self._capacity = capacity_events
        self._rings: dict[tuple[str, int], _Ring] = {}  # (topic, topic id) -> its ring
        self._first_offset = 0

    def new_epoch(self, epoch: int) -> None:
        """A new master starts numbering above every earlier master's transient events.

        The offsets of a transient topic live only in the master's memory, so a new
        master cannot continue the old one's count; starting each epoch at epoch << 32
        keeps offsets growing across a failover, and subscribers that resume after their
        last offset (and drop lower ones as duplicates) keep receiving.
        """
        self._rings.clear()
        self._first_offset = epoch << 32

    def _ring(self, topic: str, topic_id: int) -> _Ring:
        ring = self._rings.get((topic, topic_id))
        if ring is None:
            ring = self._rings[(topic, topic_id)] = _Ring(self._capacity, self._first_offset)
        return ring

    def publish(
        self,
        request: broker_pb2.PublishRequest,
        *,
        topic_id: int,
        epoch: int,
        now_ms: int,
        master_id: str,
    ) -> common_pb2.BatchReceipt:
        """Hands the events to live subscribers of the topic's incarnation topic_id; the
        receipt carries offsets but LSN 0."""
        ring = self._ring(request.topic, topic_id)
        receipt = common_pb2.BatchReceipt(
            count=len(request.events),
            first_offset=ring.next_offset,
            epoch=epoch,
            master_id=master_id,
        )
        for event in request.events:
            offset = ring.next_offset
            ring.next_offset += 1
            ring.events.append(
                common_pb2.Event(
                    topic=request.topic,
                    offset=offset,
                    key=event.key,
                    payload=event.payload,
                    headers=event.headers,
                    timestamp_ms=now_ms,
                    publisher_id=request.publisher_id,
                    sequence=event.sequence,
                    epoch=epoch,
                    session_token=request.session_token,
                )
            )
        return receipt

    def next_offset(self, topic: str, *, topic_id: int) -> int:
        """The offset the next transient event of `topic` (incarnation topic_id) gets."""
        return self._ring(topic, topic_id).next_offset

    def read(
        self, topic: str, from_offset: int, max_events: int, *, topic_id: int, max_bytes: int = 0
    ) -> list[common_pb2.Event]:
        """Events at or after from_offset still in the ring (skipping ahead if needed).

        At most max_events and, when max_bytes > 0, no more encoded event bytes than that
        (but at least one event), as Store.read_events.
        """
        ring = self._ring(topic, topic_id)
        if not ring.events or from_offset >= ring.next_offset:
            return []
        first = ring.events[0].offset
        start = max(from_offset, first) - first
        out: list[common_pb2.Event] = []
        size_bytes = 0
        for i in range(start, min(len(ring.events), start + max_events)):
            event = ring.events[i]
            size_bytes += framed_event_bytes(event.ByteSize())
            if max_bytes > 0 and out and size_bytes > max_bytes:
                break
            out.append(event)
        return out

    def drop(self, topic: str) -> None:
        """Forgets the rings of every incarnation of a destroyed topic."""
        for key in [k for k in self._rings if k[0] == topic]:
            del self._rings[key]
