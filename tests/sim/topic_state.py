"""Topics, events and publisher dedupe in the replication simulator, with the real code.

A topic command is planned by the shipped writer planning (``ReplicaDriver.plan_batch``,
the production ``BatchBuilder``) over the master's real store (the simulator's nodes each
keep one, ``Store`` over ``MemoryKV``), so deduplication, destroy and re-creation run the
production code, and what a node holds of the topic is read from its store.
"""

from __future__ import annotations

from dataclasses import dataclass

from squall.v1 import broker_pb2, common_pb2
from squall_server.common.config import LimitsConfig
from squall_server.replica import commands
from squall_server.replica.store import Store

# The topic the workload creates, destroys and re-creates, and its one fixed publisher.
TOPIC = "dd"
PUBLISHER_ID = "pub-fixed"
# Sequences are drawn from 1..SEQUENCES_MAX, so retries and re-used ids are frequent.
SEQUENCES_MAX = 5
LIMITS = LimitsConfig()


@dataclass(frozen=True)
class Receipt:
    """What a master answered a topic publish (one event): where the event is."""

    topic_id: int
    offset: int
    sequence: int
    duplicate: bool


def command(kind: str, sequence: int) -> commands.Command:
    """The workload's command of a kind ("create", "destroy", "publish")."""
    if kind == "create":
        return commands.CreateTopic(TOPIC, common_pb2.TOPIC_KIND_REPLICATED)
    if kind == "destroy":
        return commands.DestroyTopic(TOPIC)
    return commands.Publish(
        broker_pb2.PublishRequest(
            topic=TOPIC,
            publisher_id=PUBLISHER_ID,
            events=[common_pb2.EventData(payload=b"s%d" % sequence, sequence=sequence)],
        )
    )


def event_at(store: Store, offset: int) -> tuple[int, str, int] | None:
    """(topic id, publisher id, sequence) of the event stored at offset in the topic as
    the node's store holds it now, or None."""
    info = store.get_topic(TOPIC)
    if info is None or not info.first_offset <= offset < info.next_offset:
        return None
    (event,) = store.read_events(TOPIC, offset, 1)
    return info.topic_id, event.publisher_id, event.sequence
